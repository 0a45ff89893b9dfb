"""Continuous generation against batch-level asynchronous generation, side by side in one
invocation, on a workload with long-tailed response lengths: batch mode at k = 1 (today's
asynchronous recipe) and k = 2, continuous at k = 2.

Why continuous needs k >= 2: max_staleness bounds the oldest token of a sample, so with k = 1
a group for batch b + 1 may only start once the weights of step b are loaded, which is exactly
when batch mode starts it too; the engine cannot fill batch b's tail with the next batch's
work. With k = 2 it can (generator/continuous.py admits a group when it can still be fresh in
the batch it will land in).

Workload: the tiny model randomly initialised (not warm-started), on the reverse task's
prompts. Its responses end at EOS with a probability of about 1/45 per token, so they run from
1 token to the 100-token cap (median about 30; the longest of a batch is several times the
median), as RL responses do. 1 trainer rank + 1 engine (one core each on the 2-core machine),
AIPO, packed micro-batches (so that, as in real RL, generation is the
bottleneck), the same seed. Per mode, over the steps after --warmup:

* steps/s: steps / the trainer's total step time;
* generated tokens/s: tokens generated / the total step time;
* engine busy share: batch mode: generate_s / the step time (the engine is busy from the first
  to the last token of a batch, waiting for its longest sample); continuous mode: the share of
  the time it spent in engine steps (engine_busy_share, weighted by each batch's wall time),
  with the shares it spent loading weights (or blocked waiting for them) and held back with
  nothing admissible (engine_load_share, engine_held_share);
* trainer wait: the trainer's mean wait for the next batch (wait_s).

    python bench/continuous_generation.py [--steps 40] [--warmup 5] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/tiny_grpo_cpu.yaml"
WORKLOAD = ["trainer.ranks=1", "generator.engines=1", "run.eval_every=0",
            "data.eval_prompts=16", "algorithm.correction=aipo",
            "generator.max_new_tokens=100", "generator.max_model_len=128", "trainer.lr=1e-4",
            "trainer.max_tokens_per_micro_batch=2048"]


def random_tiny_model() -> str:
    from llamarl.tiny.model import build_model, save_hf_dir

    path = Path(tempfile.gettempdir()) / "llamarl-bench-tiny-random"
    if not (path / "config.json").exists():
        model, tok = build_model(seed=0)
        save_hf_dir(path, model.state_dict(), model.config, tok)
    return str(path)


def run(mode: str, k: int, steps: int, extra: list[str]) -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix=f"llamarl-bench-{mode}-"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "llamarl.launch", RECIPE, f"run.steps={steps}", f"run.output_dir={out}",
           f"model.path={random_tiny_model()}", f"generator.mode={mode}",
           f"sync.max_staleness={k}", *WORKLOAD, *extra]
    with open(out / "log.txt", "w") as log:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict], mode: str) -> dict:
    """Throughput over the steady state: totals over the steps after --warmup, not medians of
    per-step figures. Continuous mode's steps are periodic (a batch that waited for its
    longest response, then batches that were ready), and the median of such a cycle is its
    short steps: it overstated continuous mode by 1.3x in an earlier version of this bench."""
    total = sum(r["step_time_s"] for r in rows)
    busy = (sum(r["engine_busy_share"] * r["generate_s"] for r in rows)
            / sum(r["generate_s"] for r in rows) if mode == "continuous" else
            min(sum(r["generate_s"] for r in rows) / total, 1.0))
    out = {"steps_per_s": len(rows) / total, "step_time_s": total / len(rows),
           "step_time_median_s": statistics.median(r["step_time_s"] for r in rows),
           "generated_tokens_per_s": sum(r["tokens_generated"] for r in rows) / total,
           "engine_busy_share": busy,
           "trainer_wait_s": statistics.mean(r["wait_s"] for r in rows),
           "response_len": statistics.mean(r["response_len"] for r in rows),
           "staleness_mean": statistics.mean(r["staleness_mean"] for r in rows),
           "mismatch_kl": statistics.mean(r["mismatch_kl"] for r in rows)}
    if mode == "continuous":
        weighted = {key: sum(r[key] * r["generate_s"] for r in rows)
                    / sum(r["generate_s"] for r in rows)
                    for key in ("engine_load_share", "engine_held_share")}
        out.update(weighted,
                   spanning_share=statistics.mean(r["spanning_share"] for r in rows),
                   version_spread_mean=statistics.mean(r["version_spread_mean"] for r in rows),
                   in_flight_mean=statistics.mean(r["in_flight_mean"] for r in rows),
                   recomputed_tokens_per_step=statistics.mean(r["recomputed_tokens"]
                                                              for r in rows),
                   stale_groups_discarded=sum(r["stale_groups_discarded"] for r in rows))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the totals")
    ap.add_argument("--out", default="bench/results/continuous_generation.json")
    args, extra = ap.parse_known_args()
    result = {"workload": WORKLOAD + extra, "steps": args.steps, "warmup": args.warmup}
    for mode, k in (("batch", 1), ("batch", 2), ("continuous", 2)):
        rows = run(mode, k, args.steps, extra)[args.warmup:]
        result[f"{mode}_k{k}"] = summary(rows, mode)
    for name in ("batch_k1", "batch_k2"):
        result[f"continuous_k2_over_{name}"] = (result["continuous_k2"]["steps_per_s"]
                                               / result[name]["steps_per_s"])
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
