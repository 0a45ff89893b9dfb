"""The rollout data path from the engine's outputs to the loss's micro-batches, without the
model: what the buffer and the collation cost per rollout batch, on the default recipe's
shapes (64 prompts x 8 samples of 8-15 prompt and 2-12 completion tokens, 2 trainer ranks,
micro-batches of 64).

    record          engine completions + rewards -> RolloutBatch (generator)
    split           whole groups over the trainer ranks
    put / get       shared-memory channel, both ends in this process (a real TCPStore)
    concat_drop     the trainer's concat of its parts + the staleness filter
    micro_batches   one rank's padded micro-batches with advantages attached

Medians over --repeats in milliseconds, written to bench/results/data_path.json (with the
schema's keys of bench/harness.py, the raw repeats under "after_all"). The
"before" figures in that file were measured with the same shapes on the per-row record
(commit 8c15b25: tensor -> list -> tensor in split/select, a second copy on receive,
per-micro-batch collation).

    python bench/data_path.py
"""

from __future__ import annotations

import json
import random
import time
from types import SimpleNamespace

import torch
from harness import bench_parser, median, write_result
from torch.distributed import TCPStore

from llamarl.buffer.record import RolloutBatch, Sample, split_groups
from llamarl.buffer.shm import ShmChannel, sweep_run
from llamarl.generator.engine import Completion
from llamarl.generator.loop import _to_batch
from llamarl.rewards.scorer import ScoredGroup
from llamarl.trainer import rl_step
from llamarl.trainer.policy import pad_rollouts
from llamarl.trainer.rollouts import drop_stale

BEFORE_8C15B25 = {"record": 1.883, "split": 3.949, "put": 0.959, "get": 0.929,
                  "concat_drop": 0.155, "micro_batches": 15.294, "total": 23.168}


def engine_groups(prompts: int, samples: int, seed: int = 0) -> list[ScoredGroup]:
    rng = random.Random(seed)
    groups = []
    for j in range(prompts):
        prompt = SimpleNamespace(token_ids=[rng.randrange(3, 40)
                                            for _ in range(rng.randrange(8, 16))])
        comps = []
        for _ in range(samples):
            n = rng.randrange(2, 13)
            comps.append(Completion([rng.randrange(3, 40) for _ in range(n)],
                                    [-rng.random() for _ in range(n)], "stop", ""))
        groups.append(ScoredGroup(prompt, comps, [rng.random() for _ in comps], {}, j))
    return groups


def main() -> None:
    args = bench_parser("data_path", __doc__, repeats=30).parse_args()
    groups = engine_groups(64, 8)
    store = TCPStore("127.0.0.1", 0, 1, True)
    run_id = f"benchdp{time.monotonic_ns()}"
    chans = [ShmChannel(store, run_id, f"c{t}", 4) for t in range(2)]
    cfg = SimpleNamespace(algorithm=SimpleNamespace(loss_agg="token_mean"),
                          generator=SimpleNamespace(max_new_tokens=12))
    times: dict[str, list[float]] = {k: [] for k in BEFORE_8C15B25 if k != "total"}
    try:
        for _ in range(args.repeats):
            t = time.perf_counter()
            for grp in groups:  # what the single-turn source does with the engine's outputs
                grp.samples = []
                for c in grp.completions:
                    s = Sample(finish="stop")
                    s.add_context(grp.prompt.token_ids)
                    s.add_sampled(c.token_ids, c.logprobs, 0)
                    grp.samples.append(s)
            batch = _to_batch(groups, 0, 0, 64)
            times["record"].append(time.perf_counter() - t)
            t = time.perf_counter()
            parts = split_groups(batch, 2)
            times["split"].append(time.perf_counter() - t)
            t = time.perf_counter()
            for ch, part in zip(chans, parts):
                ch.put(part)
            times["put"].append(time.perf_counter() - t)
            t = time.perf_counter()
            got = [ch.get() for ch in chans]
            times["get"].append(time.perf_counter() - t)
            t = time.perf_counter()
            mine, _ = drop_stale(RolloutBatch.concat([got[0]]), 0, 0)
            times["concat_drop"].append(time.perf_counter() - t)
            t = time.perf_counter()
            full = pad_rollouts(mine, 0)
            full.advantages = torch.randn(len(mine))
            rl_step._mini_batch(full, torch.arange(len(mine)), full.take([0]),
                               rl_step.MicroBatching(64), cfg)
            times["micro_batches"].append(time.perf_counter() - t)
    finally:
        sweep_run(run_id)
    after = {k: round(median(v) * 1e3, 3) for k, v in times.items()}
    after["total"] = round(sum(after.values()), 3)
    result = {"unit": "ms per rollout batch (median)", "repeats": args.repeats,
              "before_8c15b25": BEFORE_8C15B25, "after": after,
              "speedup": round(BEFORE_8C15B25["total"] / after["total"], 2),
              "after_all": {k: [round(x * 1e3, 3) for x in v] for k, v in times.items()}}
    print(json.dumps({k: v for k, v in result.items() if k != "after_all"}, indent=1))
    print(f"wrote {write_result('data_path', result, args)}")


if __name__ == "__main__":
    main()
