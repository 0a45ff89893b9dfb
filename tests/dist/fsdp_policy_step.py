"""torchrun --nproc-per-node N: one RL update with FSDP2 on the gloo trainer group; rank 0
saves the updated full weights (policy, and PPO's critic) and the stats to $OUT, for comparison
with an unsharded or differently sharded run.

Env: OUT (output file), EXTRA (space-separated recipe overrides), MODEL_DIR (a HF directory of
the tiny model, needed for PPO's critic and a reference model), DEVICE (cpu, the default, on
gloo; or cuda: one GPU per rank on NCCL), PLACE=1: a weight sender is built first, which moves
the shards into its send buffers (fsdp.place_shards), and the step must take them along;
CHUNK_MIB: the logprobs' chunk size (llamarl.trainer.policy.LOGPROB_CHUNK_MIB), small enough
to take the chunked LM head under FSDP2. Also saved: how many times each decoder block's
parameters were all-gathered in the step, and whether they are sharded again after it."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_buffer import make_batch  # noqa: E402
from trainer_world import exit_process, trainer_world  # noqa: E402

from llamarl.buffer.record import split_groups  # noqa: E402
from llamarl.config import load_config  # noqa: E402
from llamarl.parallel.fsdp import apply_fsdp, decoder_blocks  # noqa: E402
from llamarl.parallel.weight_sender import WeightSender  # noqa: E402
from llamarl.tiny.model import build_model  # noqa: E402
from llamarl.trainer import policy as policy_mod  # noqa: E402
from llamarl.trainer.critic import build_critic  # noqa: E402
from llamarl.trainer.parts import load_reference  # noqa: E402
from llamarl.trainer.rl_step import policy_step  # noqa: E402
from llamarl.trainer.step import PolicyTrainer  # noqa: E402

# padded rows unless EXTRA says otherwise (trainer.share_prompts=true: the shared-prompt layout)
CFG = ["trainer.micro_batch_size=3", "trainer.lr=1e-2", "trainer.ranks=2",
       "trainer.share_prompts=false"]


def count_gathers() -> dict:
    """id(FSDPParamGroup) -> all-gathers of its parameters from now on (unshard calls that
    found them sharded with no gather in flight: a prefetched gather is counted once)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    counts: dict = {}
    unshard = FSDPParamGroup.unshard

    def counted(self, *args, **kwargs):
        if self.is_sharded and self._all_gather_result is None:
            counts[id(self)] = counts.get(id(self), 0) + 1
        return unshard(self, *args, **kwargs)

    FSDPParamGroup.unshard = counted
    return counts


def full(model):
    return {k: v.full_tensor().detach().cpu().clone() for k, v in model.state_dict().items()}


if __name__ == "__main__":
    rank, world, mesh, device = trainer_world()
    if os.environ.get("CHUNK_MIB"):
        chunk = float(os.environ["CHUNK_MIB"])
        policy_mod.LOGPROB_CHUNK_MIB = policy_mod.LOGPROB_CHUNK_MIB_CUDA = chunk
    cfg = load_config(None, CFG + os.environ.get("EXTRA", "").split())
    model, tok = build_model(seed=0)
    model.to(device)
    apply_fsdp(model, mesh, torch.float32,
               gradient_checkpointing=cfg.trainer.gradient_checkpointing)
    steps = cfg.algorithm.epochs * cfg.algorithm.mini_batches
    sender = None
    if os.environ.get("PLACE"):  # no transport: only its send buffers are used here
        sender = WeightSender(model, rank, 1, None, device)
    trainer = PolicyTrainer(model, cfg.trainer, steps, world, device)
    path = os.environ.get("MODEL_DIR", "")
    critic = build_critic(cfg, path, mesh, device, steps, world) if cfg.algorithm.name == "ppo" \
        else None
    reference = load_reference(cfg, path, mesh, device)
    batch = split_groups(make_batch(4, 4, seed=5), world)[rank]
    gathers = count_gathers()
    stats = policy_step(trainer, batch, cfg, tok.pad_token_id, reference=reference,
                        critic=critic)
    groups = [b._get_fsdp_state()._fsdp_param_group for b in decoder_blocks(model)]
    out = {"state": full(model), "stats": stats,
           "block_gathers": [gathers.get(id(g), 0) for g in groups],
           "blocks_resharded": all(g.is_sharded for g in groups),
           # the blocks' settings after the step: apply_fsdp's again (all but the last free
           # their parameters after forward; all after backward)
           "reshard_after_forward": [g.post_forward_mesh_info is not None for g in groups],
           "reshard_after_backward": [g.reshard_after_backward for g in groups],
           "grads": {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters()},
           "checkpointing": bool(getattr(model, "is_gradient_checkpointing", False))}
    if critic is not None:
        out["critic"] = full(critic.model)
    if sender is not None:  # the send buffers hold the updated shards themselves
        local = sender._local_tensors()
        slots = [(name, slot) for slots in sender._slots for name, slot in slots]
        out["placed"] = len(sender.placed)
        out["in_slots"] = all(torch.equal(local[name], slot) and
                              local[name].data_ptr() == slot.data_ptr() for name, slot in slots
                              if name in sender.placed)
        # FSDP2 pads a shard with fewer rows than the first rank's: those stay where they are
        even = sum(m.local_rows == -(-m.shape[0] // world) for b in sender.buckets
                   for m, _ in b.entries)
        mine = torch.tensor([out["placed"], even, len(slots)], dtype=torch.float64)
        counts = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(counts, mine)
        out["placed_even_slots"] = [[int(x) for x in c] for c in counts]
    if rank == 0:
        torch.save(out, os.environ["OUT"])
    exit_process()
