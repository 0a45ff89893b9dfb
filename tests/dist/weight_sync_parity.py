"""torchrun --nproc-per-node 2 + ENGINES x TP (2 FSDP2 trainer ranks + $ENGINES vLLM engines,
default 1, of $TP ranks, default 1), via llamarl's own runtime. With LLAMARL_GLOO_BROADCAST=1
the weights travel as NCCL's do (broadcasts, received sender by sender, per-tp-rank groups). The trainers change the policy with real optimizer steps and broadcast it, twice; the
generator compares its engine with the trainer's model before and after each sync and writes
the findings to $OUT (JSON). The first sync goes through vLLM's load_weights (and records it),
the second replays the recorded copies straight from the receive buffers. With TP = 2 the
engine's leader makes the comparisons while its other rank follows its calls (generator/tp.py):
the engine's outputs need both ranks' shards, so they check every rank's weights. With
OVERRIDES model.lora.rank=N the policy is a LoRA one (trainer/lora.py): only its adapters
train, and the engine gets the merged weights W + s B A under the base model's names; with
model.lora.sync=adapters too, the engine runs the base model from the checkpoint with vLLM's
LoRA layers and gets A and B alone, and a third sync, of unchanged adapters, must leave its
logprobs exactly as they were."""

import json
import os
import time

import torch

from llamarl.buffer.shm import sweep_run
from llamarl.config import load_config
from llamarl.runtime.dist_env import from_environ
from llamarl.runtime.layout import compute_layout
from llamarl.runtime.setup import setup

# The last prompt (37 tokens) fills a KV-cache block (generator.block_size=32), which the
# prefix cache keeps from the generate before a sync: reusing it after the sync would show as
# logprobs that differ from the trainer's model.
PROMPTS = ["abc=", "hello=", "kjf=", "aaab=", "lkji=", "bca=", "hello world " * 6]


def trainer(rt, model_dir):
    from transformers import AutoTokenizer

    from llamarl.config import adapter_sync
    from llamarl.parallel.fsdp import apply_fsdp
    from llamarl.parallel.weight_sync import open_sender
    from llamarl.trainer.loop import init_trainer_group
    from llamarl.trainer.lora import add_adapters, merged_state_dict
    from llamarl.trainer.policy import load_policy
    from llamarl.trainer.step import PolicyTrainer
    from llamarl.trainer.warmstart import sft_batches

    mesh = init_trainer_group(rt)
    model = load_policy(model_dir, "float32")
    tok = AutoTokenizer.from_pretrained(model_dir)
    lora = rt.cfg.model.lora.rank > 0  # LoRA: only the adapters train; sent merged
    if lora:
        add_adapters(model, rt.cfg.model.lora, seed=0)
    apply_fsdp(model, mesh, torch.float32)
    sender = open_sender(rt, model)  # each trainer rank sends its own shards
    rt.wait_key("gen/before_done")
    pt = PolicyTrainer(model, rt.cfg.trainer, 8, 2, rt.device)
    # adapter syncs: a third of unchanged adapters (no steps) must change nothing
    syncs = ((1, range(5)), (2, range(5, 8))) + (((3, ()),) if adapter_sync(rt.cfg) else ())
    for sync, steps in syncs:
        for step in steps:  # supervised steps: a real, large change of every weight
            mbs = sft_batches(tok, step, rt.role.index, 2, micro=32)
            n = float(sum(mb.mask.sum() for mb in mbs)) * 2
            pt.step(mbs, lambda logp, mb, _ent: (-(logp * mb.mask).sum() / n, {}))
        sender.send(model)
        state = (merged_state_dict(model) if lora else  # the base model's names
                 {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()})
        if rt.role.index == 0:
            torch.save(state, os.environ["OUT"] + f".{sync}.pt")
            rt.store.set(f"trainer/saved/{sync}", "1")
    rt.store.add("trainer/nbuckets", len(sender.buckets))
    rt.store.add("trainer/sent_as_is", sum(sender.direct))  # straight from the parameters
    rt.store.add("trainer/sent", 1)


def generator(rt, model_dir):
    from llamarl.config import adapter_sync
    from llamarl.generator.engine import Engine
    from llamarl.generator.loop import engine_commands, engine_world, join_weight_groups
    from llamarl.generator.tp import follow_leader

    tp = rt.layout.tp
    adapters = adapter_sync(rt.cfg)  # the base from the checkpoint, vLLM's LoRA layers
    engine = Engine(model_dir, rt.cfg.generator, "float32", seed=0, on_cpu=rt.on_cpu,
                    world=engine_world(rt), lora_rank=rt.cfg.model.lora.rank if adapters else 0)
    join_weight_groups(rt, engine)
    if tp > 1:
        commands = engine_commands(rt)
        if not rt.role.is_engine_leader:
            follow_leader(engine, commands)
            return
        engine.commands = commands
    tok = engine.tokenizer
    ids = [[tok.bos_token_id] + tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    before = engine.generate(ids, 1, 0.0, 10, seed=0)
    sum_before = engine.checksum()
    rt.store.set("gen/before_done", "1")
    result = {"greedy_match": True, "max_abs_dlogprob": 0.0, "checksum_before": sum_before}
    for sync in (1, 2, 3) if adapters else (1, 2):
        engine.receive_weights()
        greedy = engine.generate(ids, 1, 0.0, 10, seed=0)
        sampled = engine.generate(ids, 4, 1.0, 10, seed=3)
        if sync == 3:  # unchanged adapters: the very same samples and logprobs
            result["unchanged"] = all(
                a.token_ids == b.token_ids and a.logprobs == b.logprobs
                for ga, gb in zip(greedy + sampled, last) for a, b in zip(ga, gb))
            continue
        last = greedy + sampled
        rt.wait_key(f"trainer/saved/{sync}")
        match, dlp = compare_with_hf(model_dir, os.environ["OUT"] + f".{sync}.pt", ids, greedy,
                                     sampled)
        result["greedy_match"] &= match
        result["max_abs_dlogprob"] = max(result["max_abs_dlogprob"], dlp)
        # the engine's exact bytes (every tp rank's), to compare sync schemes (sync.senders)
        result[f"sha_after_{sync}"] = engine.llm.collective_rpc(weights_sha)
        if sync == 1:
            result["changed_tokens"] = [a[0].token_ids != b[0].token_ids
                                        for a, b in zip(before, greedy)]
            result["checksum_after"] = engine.checksum()
    result["checksum_after_2"] = engine.checksum()
    # how the receives went: sender by sender (NCCL's order), and over the per-tp-rank groups
    result["ordered"], result["tp_groups"] = engine.llm.collective_rpc(
        lambda worker: (getattr(worker._llamarl_receiver.transport, "ordered", False),
                        len(getattr(worker._llamarl_receiver.transport, "tp_groups", []))))[0]
    result["senders"] = engine.llm.collective_rpc(
        lambda worker: len(worker._llamarl_receiver.plans))[0]
    result["replayed"], result["in_place"] = engine.llm.collective_rpc(
        lambda worker: (worker._llamarl_receiver.replay is not None,
                        sum(t is not f for ts, fs in zip(worker._llamarl_receiver.targets,
                                                         worker._llamarl_receiver.flats)
                            for t, f in zip(ts, fs))))[0]
    while rt.store.add("trainer/sent", 0) < 2:  # both trainer ranks counted their buckets
        time.sleep(0.01)
    if tp > 1:
        engine.commands.stop()
    # rows of the fused q/k/v projection this rank holds: all of them / tp
    result["qkv_rows"] = engine.llm.collective_rpc(
        lambda worker: worker.model_runner.model.model.layers[0].self_attn.qkv_proj.weight.shape[0]
    )[0]
    # resharded (tp > 1): the bytes this rank received in the second sync, against the first's
    result["bytes_full"], result["bytes_resharded"] = engine.llm.collective_rpc(
        lambda worker: (sum(b.numel * 4 for p in worker._llamarl_receiver.plans for b in p),
                        worker._llamarl_receiver.bytes_per_sync))[0]
    result["buckets"] = rt.store.add("trainer/nbuckets", 0)
    result["sent_as_is"] = rt.store.add("trainer/sent_as_is", 0)
    out = os.environ["OUT"] + (f".e{rt.role.index}" if rt.role.index else "")
    with open(out, "w") as f:
        json.dump(result, f)


def weights_sha(worker) -> str:
    """SHA-256 of this engine rank's parameters' bytes, in the model's order."""
    import hashlib

    h = hashlib.sha256()
    for name, p in worker.model_runner.model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def compare_with_hf(model_dir, state_path, ids, greedy, sampled) -> tuple[bool, float]:
    """Greedy tokens identical to the trainer's model's argmax, and the largest |d logprob|."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.load_state_dict(torch.load(state_path), strict=False)
    hf.tie_weights()
    hf.eval()

    def hf_logprobs(prompt, completion, temperature):
        x = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = hf(x).logits[0, len(prompt) - 1:-1].float() / temperature
        lp = torch.log_softmax(logits, -1)
        return lp.gather(-1, torch.tensor(completion)[:, None])[:, 0], lp.argmax(-1)

    max_dlp, greedy_match = 0.0, True
    for p, grp in zip(ids, greedy):
        c = grp[0]
        lp, argmax = hf_logprobs(p, c.token_ids, 1.0)
        greedy_match &= argmax.tolist() == c.token_ids
        max_dlp = max(max_dlp, (lp - torch.tensor(c.logprobs)).abs().max().item())
    for p, grp in zip(ids, sampled):
        for c in grp:
            lp, _ = hf_logprobs(p, c.token_ids, 1.0)
            max_dlp = max(max_dlp, (lp - torch.tensor(c.logprobs)).abs().max().item())
    return greedy_match, max_dlp


if __name__ == "__main__":
    # Pieces of 16 KiB and more travel alone, sent from the trainer's parameters and received
    # in place by the engine (the weight matrices of the tiny model); the small ones are
    # packed, received into buffers and copied: both paths are checked.
    model_dir = os.environ["MODEL_DIR"]
    cfg = load_config(None, [f"model.path={model_dir}", "generator.max_model_len=64",
                             "generator.block_size=32",
                             "sync.bucket_mb=1", "sync.solo_mb=0.015625",
                             "generator.max_new_tokens=10", "trainer.lr=3e-3",
                             f"run.output_dir={os.environ['RUNS']}",
                             *os.environ.get("OVERRIDES", "").split()])
    env = from_environ()
    tp, engines = int(os.environ.get("TP", "1")), int(os.environ.get("ENGINES", "1"))
    cfg.generator.tp, cfg.generator.engines = tp, engines
    rt = setup(cfg, compute_layout(env.world_size, env.local_world_size, 2, engines, tp), env,
               cleanups=(sweep_run,))
    (trainer if rt.role.role == "trainer" else generator)(rt, model_dir)
    if rt.role.role != "trainer":  # vLLM's tp segments (cpu_fixes), as the launcher's end does
        rt.cleanup_shared_memory()
    rt.watchdog.mark_done()
    rt.watchdog.stop()
    os._exit(0)
