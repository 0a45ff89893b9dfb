"""Padded micro-batches in the batch's order against rows of similar lengths together
(`rl_step.by_length`), side by side in one process: the same GRPO update of the same batch,
the two orders alternating, so the machine's drift hits both alike.

The batch has the default recipe's shapes: the embedded tiny model, 64 prompts x 8 samples,
prompts of 8-15 tokens (one length per group), completions of 1-12 tokens, micro-batches of
64 rows, one FSDP2 rank on the process's threads. Reports, per order, the median and the
minimum seconds per update over --repeats, the share of the computed tokens that are padding,
and the ratio of the medians; written to bench/results/micro_batch_order.json.

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

    cfg = load_config(None, ["trainer.micro_batch_size=64", "trainer.ranks=1"])
    model, tok = build_model(0)
    apply_fsdp(model, init_device_mesh("cpu", (1,)), torch.float32)
    trainer = PolicyTrainer(model, cfg.trainer, 10_000, 1, torch.device("cpu"))
    batch = recipe_batch(64, 8, model.config.vocab_size, seed=0)
    sort = rl_step.by_length
    orders = {"given": lambda idx, lens: idx, "by_length": sort}
    times = {name: [] for name in orders}
    padding = {}
    for i in range(args.repeats + 1):
        for name, order in orders.items():
            rl_step.by_length = order
            t0 = time.perf_counter()
            stats = rl_step.policy_step(trainer, batch, cfg, tok.pad_token_id)
            if i:  # the first of each is warm-up
                times[name].append(time.perf_counter() - t0)
            padding[name] = stats["padding_share"]
    rl_step.by_length = sort
    out = {"workload": "tiny model, 64 prompts x 8 samples, prompts 8-15 tokens, completions "
                       "1-12, micro-batches of 64 rows, 1 FSDP2 rank",
           "threads": args.threads, "repeats": args.repeats}
    for name in orders:
        out[name] = {"update_s_median": statistics.median(times[name]),
                     "update_s_min": min(times[name]), "padding_share": padding[name],
                     "update_s_all": times[name]}
    out["by_length_over_given"] = (out["by_length"]["update_s_median"]
                                   / out["given"]["update_s_median"])
    print(json.dumps(out, indent=1))
    Path("bench/results/micro_batch_order.json").write_text(json.dumps(out, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
