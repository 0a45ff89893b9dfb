"""The update's micro-batch layouts side by side in one process: the same GRPO update of the
same batch, the layouts taking turns, so the machine's drift hits all alike.

    given          padded rows in the batch's order (groups of one prompt each)
    by_length      padded rows of similar lengths together (`rl_step.by_length`, the default)
    shared_prompts each group one row, its prompt computed once (trainer.share_prompts)
    shared_prompts_256  the same, 256 samples (32 groups) per micro-batch instead of 64

The batch has the default recipe's shapes: the embedded tiny model, 64 prompts x 8 samples,
prompts of 8-15 tokens (one length per group), completions of 1-12 tokens, micro-batches of
64 rows, one FSDP2 rank on the process's threads. Reports, per layout, the median and the
minimum seconds per update over --repeats, the share of the computed tokens that are padding,
and the ratio of each median to by_length's; written to bench/results/micro_batch_order.json.

    python bench/micro_batch_order.py        # part of make bench
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


def recipe_batch(prompts: int, samples: int, vocab: int, seed: int):
    """A RolloutBatch of `prompts` groups of `samples`: prompt lengths 8-15 per group,
    completion lengths 1-12 per sample (uniform), random tokens and rewards."""
    from llamarl.buffer.record import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    ps, cs, lps, rewards, gids = [], [], [], [], []
    for p in range(prompts):
        prompt = torch.randint(3, vocab, (int(torch.randint(8, 16, (1,), generator=g)),),
                               generator=g).tolist()
        for _ in range(samples):
            c = int(torch.randint(1, 13, (1,), generator=g))
            ps.append(prompt)
            cs.append(torch.randint(3, vocab, (c,), generator=g).tolist())
            lps.append((-torch.rand(c, generator=g)).tolist())
            rewards.append(float(torch.rand(1, generator=g)))
            gids.append(p)
    return RolloutBatch.from_lists(ps, cs, lps, rewards, gids, [True] * len(ps), 0, 0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=15, help="updates per order")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=0, world_size=1)
    from llamarl.config import load_config
    from llamarl.parallel.fsdp import apply_fsdp
    from llamarl.tiny.model import build_model
    from llamarl.trainer import rl_step
    from llamarl.trainer.step import PolicyTrainer

    base = ["trainer.micro_batch_size=64", "trainer.ranks=1"]
    model, tok = build_model(0)
    apply_fsdp(model, init_device_mesh("cpu", (1,)), torch.float32)
    cfg = load_config(None, base)
    trainer = PolicyTrainer(model, cfg.trainer, 10_000, 1, torch.device("cpu"))
    batch = recipe_batch(64, 8, model.config.vocab_size, seed=0)
    sort = rl_step.by_length
    # layout -> (recipe overrides, padded rows' order)
    layouts = {"given": ([], lambda idx, lens: idx), "by_length": ([], sort),
               "shared_prompts": (["trainer.share_prompts=true"], sort),
               "shared_prompts_256": (["trainer.share_prompts=true",
                                       "trainer.micro_batch_size=256"], sort)}
    cfgs = {name: load_config(None, base + extra) for name, (extra, _) in layouts.items()}
    times = {name: [] for name in layouts}
    padding = {}
    for i in range(args.repeats + 1):
        for name, (_, order) in layouts.items():
            rl_step.by_length = order
            t0 = time.perf_counter()
            stats = rl_step.policy_step(trainer, batch, cfgs[name], tok.pad_token_id)
            if i:  # the first of each is warm-up
                times[name].append(time.perf_counter() - t0)
            padding[name] = stats["padding_share"]
    rl_step.by_length = sort
    out = {"workload": "tiny model, 64 prompts x 8 samples, prompts 8-15 tokens, completions "
                       "1-12, micro-batches of 64 rows (256: shared_prompts_256), 1 FSDP2 rank",
           "threads": args.threads, "repeats": args.repeats}
    for name in layouts:
        out[name] = {"update_s_median": statistics.median(times[name]),
                     "update_s_min": min(times[name]), "padding_share": padding[name],
                     "update_s_all": times[name]}
    for name in layouts:
        if name != "by_length":
            out[f"{name}_over_by_length"] = (out[name]["update_s_median"]
                                             / out["by_length"]["update_s_median"])
    print(json.dumps(out, indent=1))
    Path("bench/results/micro_batch_order.json").write_text(json.dumps(out, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
