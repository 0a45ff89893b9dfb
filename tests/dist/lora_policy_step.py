"""torchrun --nproc-per-node 2: a LoRA policy (model.lora, trainer/lora.py) on FSDP2 gloo
trainer ranks takes two GRPO updates with a KL term to its reference (the same module with
its adapters off), checkpointing between them; rank 0 saves what tests/test_lora.py checks
to $OUT:

  (EXTRA: recipe overrides, e.g. model.lora.modules_to_save=[norm]; "adapters" below are
  every trained tensor: A and B, and the modules_to_save's trained copies)
  grads / opt_state   the parameters that got a gradient, and optimizer state
  base_before/after   the frozen base weights (full) before and after the updates
  ref_logp, base_logp the reference's logprobs of a batch (adapters off, after the updates)
                      and those of an FSDP2-sharded copy of the base model without adapters
  policy_logp         the adapted policy's logprobs of that batch
  merged_local        what the weight sender sends (merged W + s B A pieces, gathered)
  merged_full         lora.merged_state_dict (the exported policy's weights)
  adapters_1          the adapters after the first update, and `checkpoint`, its checkpoint
                      (meta.json names MODEL_DIR, the base: build_model(seed=0) saved)
  resumed             the second update again, from the checkpoint written after the first,
                      into a fresh model: its adapters (full), to compare with the first run's
  bf16_twins          with bfloat16 compute, the first update of a policy whose frozen base
                      stays float32 and of one whose base is kept in bfloat16
                      (lora.store_frozen_in): their stats, adapters after, merged weights,
                      and the bytes the second saved
"""

import dataclasses
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_buffer import make_batch  # noqa: E402
from trainer_world import exit_process, trainer_world  # noqa: E402

from llamarl.buffer.record import split_groups  # noqa: E402
from llamarl.config import load_config  # noqa: E402
from llamarl.parallel.fsdp import apply_fsdp  # noqa: E402
from llamarl.parallel.weight_sender import WeightSender  # noqa: E402
from llamarl.runtime.run_dir import latest  # noqa: E402
from llamarl.tiny.model import build_model  # noqa: E402
from llamarl.trainer import checkpoint  # noqa: E402
from llamarl.trainer.parts import load_reference  # noqa: E402
from llamarl.trainer.lora import (  # noqa: E402
    add_adapters,
    is_trainable,
    merged_state_dict,
    store_frozen_in,
)
from llamarl.trainer.policy import pad_rollouts, token_logprobs  # noqa: E402
from llamarl.trainer.rl_step import policy_step  # noqa: E402
from llamarl.trainer.step import PolicyTrainer  # noqa: E402

CFG = ["trainer.micro_batch_size=3", "trainer.lr=1e-2", "trainer.ranks=2",
       "trainer.share_prompts=false", "model.lora.rank=4", "model.lora.alpha=8",
       "algorithm.kl_coef=0.1"]


def full(state):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
            for k, v in state.items()}


def lora_policy(cfg, mesh):
    model, tok = build_model(seed=0)
    add_adapters(model, cfg.model.lora, seed=cfg.run.seed)
    apply_fsdp(model, mesh, torch.float32)
    return model, tok


if __name__ == "__main__":
    rank, world, mesh, device = trainer_world()
    cfg = load_config(None, CFG + os.environ.get("EXTRA", "").split())
    model, tok = lora_policy(cfg, mesh)
    base_before = {k: v for k, v in full(model.state_dict()).items() if not is_trainable(k)}
    trainer = PolicyTrainer(model, cfg.trainer, 2, world, device)
    reference = load_reference(cfg, "", mesh, device, policy=model)
    batches = [split_groups(make_batch(4, 4, seed=s), world)[rank] for s in (5, 6)]
    run = os.environ["OUT"] + ".run"
    # the reference's forward comes first (policy_step computes ref_logp before the update)
    stats = policy_step(trainer, batches[0], cfg, tok.pad_token_id, reference=reference)
    checkpoint.save(run, 1, model, trainer.opt, trainer.sched, keep=2, meta={
        "policy_version": 1, "model_path": os.environ["MODEL_DIR"], "dtype": "float32",
        "lora": dataclasses.asdict(cfg.model.lora)})
    adapters_1 = {k: v for k, v in full(model.state_dict()).items() if is_trainable(k)}
    policy_step(trainer, batches[1], cfg, tok.pad_token_id, reference=reference)
    out = {"stats": stats,
           "grads": sorted(n for n, p in model.named_parameters() if p.grad is not None),
           "opt_state": len(trainer.opt.state),
           "opt_params": sum(len(g["params"]) for g in trainer.opt.param_groups),
           "adapters": sorted(n for n, _ in model.named_parameters() if is_trainable(n)),
           "base_before": base_before}
    state = full(model.state_dict())
    out["base_after"] = {k: v for k, v in state.items() if not is_trainable(k)}
    out["adapters_after"] = {k: v for k, v in state.items() if is_trainable(k)}

    # the reference (adapters off) against the base model itself, sharded alike
    base, _ = build_model(seed=0)
    apply_fsdp(base, mesh, torch.float32)
    probe = pad_rollouts(make_batch(3, 2, seed=9), tok.pad_token_id)
    with torch.no_grad():
        out["ref_logp"] = token_logprobs(reference, probe, 1.0)[0]
        out["base_logp"] = token_logprobs(base, probe, 1.0)[0]
        out["policy_logp"] = token_logprobs(model, probe, 1.0)[0]

    # what a merged-mode weight sync sends (no transport: its pieces only), gathered by rows
    sender = WeightSender(model, rank, 1, None, device)
    local = sender._local_tensors()
    pieces = [None] * world
    dist.all_gather_object(pieces, {m.name: (m.row0, local[m.name].clone())
                                    for m in sender.metas if m.numel and m.name in local})
    merged_local = {}
    for m in sender.metas:
        rows = sorted((p[m.name] for p in pieces if m.name in p), key=lambda x: x[0])
        merged_local[m.name] = (rows[0][1] if m.rows < 0 else
                                torch.cat([t for _, t in rows]))
    out["merged_local"] = merged_local
    out["merged_full"] = {k: v.cpu() for k, v in merged_state_dict(model).items()}
    out["bytes_per_sync"] = sender.bytes_per_sync  # this rank's
    out["bytes_per_sync_base"] = WeightSender(base, rank, 1, None, device).bytes_per_sync

    # resume: a fresh model and trainer from the checkpoint after update 1, then update 2
    model2, _ = lora_policy(cfg, mesh)
    trainer2 = PolicyTrainer(model2, cfg.trainer, 2, world, device)
    ref2 = load_reference(cfg, "", mesh, device, policy=model2)
    checkpoint.load(latest(run), model2, trainer2.opt, trainer2.sched)
    policy_step(trainer2, batches[1], cfg, tok.pad_token_id, reference=ref2)
    out["resumed"] = {k: v for k, v in full(model2.state_dict()).items() if is_trainable(k)}
    out["adapters_1"] = adapters_1
    out["checkpoint"] = str(latest(run))
    out["checkpoint_files"] = sorted(p.name for p in latest(run).iterdir())

    # bfloat16 compute: the frozen base stored in bfloat16 against a float32 base that FSDP2
    # casts for every forward
    twins = []
    for keep in (False, True):
        m, _ = build_model(seed=0)
        add_adapters(m, cfg.model.lora, seed=cfg.run.seed)
        frozen = sum(p.numel() for p in m.parameters() if not p.requires_grad)
        saved = store_frozen_in(m, torch.bfloat16) if keep else 0
        apply_fsdp(m, mesh, torch.bfloat16)
        t = PolicyTrainer(m, cfg.trainer, 2, world, device)
        s = policy_step(t, batches[0], cfg, tok.pad_token_id,
                        reference=load_reference(cfg, "", mesh, device, policy=m))
        twins.append({"stats": s, "saved": saved, "frozen": frozen,
                      "dtypes": sorted({str(p.dtype) for p in m.parameters()}),
                      "adapters": {k: v for k, v in full(m.state_dict()).items()
                                   if is_trainable(k)},
                      "merged": {k: v.cpu() for k, v in merged_state_dict(m).items()}})
    out["bf16_twins"] = twins
    if rank == 0:
        torch.save(out, os.environ["OUT"])
    dist.barrier()
    exit_process()
