"""Asynchronous (max_staleness = 1) vs synchronous (0) training throughput, and the
experience buffer's cost, measured side by side in one invocation.

Both runs use the same recipe and launcher, sized so generation and training take similar
time on this machine (1 trainer rank + 1 engine: one core each on a 2-core box). Reports
median step time, trainer steps per second and their ratio; the buffer's share of the step
(median of `buffer_s / step_time_s`, where buffer_s = the trainer's read + the generator's
write of a batch); and the buffer's raw rate (rollouts per second through one shared-memory
channel between two processes, batches of the recipe's size).

    python bench/async_pipeline.py [--steps 60] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from launch_logs import torchrun_logs_in_temp

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/tiny_grpo_cpu.yaml"
LAYOUT = ["trainer.ranks=1", "generator.engines=1", "run.eval_every=0", "data.eval_prompts=16"]


def run(steps: int, k: int, extra: list[str], out: Path) -> list[dict]:
    args = [RECIPE, f"run.steps={steps}", f"sync.max_staleness={k}", f"run.output_dir={out}",
            *LAYOUT, *extra]
    if k > 0:
        args.append("algorithm.correction=aipo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "llamarl.launch", *args]
    with open(out / "log.txt", "w") as log:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _consumer(port: int, n: int, q) -> None:
    import torch.distributed as dist

    from llamarl.buffer.shm import ShmChannel

    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=60))
    ch = ShmChannel(store, "bench", "b0", capacity=4)
    t0 = time.perf_counter()
    rollouts = sum(len(ch.get()) for _ in range(n))
    q.put((rollouts, time.perf_counter() - t0))


def buffer_rate(n_batches: int, prompts: int, samples: int) -> float:
    """Rollouts per second through one ShmChannel between two processes."""
    import torch.distributed as dist

    from llamarl.buffer.record import RolloutBatch
    from llamarl.buffer.shm import ShmChannel, sweep_run

    rows = prompts * samples  # the recipe's batch: 8-token prompts, 12-token completions
    batch = RolloutBatch.from_lists([[1] + [5] * 7] * rows, [[6] * 12] * rows,
                                    [[-0.5] * 12] * rows, [0.5] * rows,
                                    [i // samples for i in range(rows)], [True] * rows, 0, 0)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_consumer, args=(store.port, n_batches, q))
    proc.start()
    ch = ShmChannel(store, "bench", "b0", capacity=4)
    try:
        for _ in range(n_batches):
            ch.put(batch)
        rollouts, seconds = q.get(timeout=120)
        proc.join(30)
    finally:
        ch.close()
        sweep_run("bench")
    return rollouts / seconds


def main() -> None:
    torchrun_logs_in_temp()  # (bench/launch_logs.py)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    w = args.warmup
    res = {}
    for k in (0, 1):
        out = Path(tempfile.mkdtemp(prefix=f"llamarl-async-k{k}-"))
        rows = run(args.steps, k, args.overrides, out)[w:]
        shutil.rmtree(out, ignore_errors=True)  # (the run's directory: its rows are read)
        step = statistics.median(r["step_time_s"] for r in rows)
        res[k] = {
            "step_time_s": step, "steps_per_s": 1 / step,
            "generate_s": statistics.median(r["generate_s"] for r in rows),
            "train_s": statistics.median(r["train_s"] for r in rows),
            "wait_s": statistics.median(r["wait_s"] for r in rows),
            "buffer_share": statistics.median(r["buffer_s"] / r["step_time_s"] for r in rows),
            "buffer_s": statistics.median(r["buffer_s"] for r in rows),
            "staleness_mean": statistics.mean(r["staleness_mean"] for r in rows),
            "wall_s": rows[-1]["elapsed_s"] - rows[0]["elapsed_s"] + rows[0]["step_time_s"],
        }
    from llamarl.config import load_config

    cfg = load_config(ROOT / RECIPE, args.overrides)
    rate = buffer_rate(50, cfg.generator.prompts_per_step, cfg.generator.samples_per_prompt)
    report = {"steps": args.steps, "warmup_skipped": w, "sync_k0": res[0], "async_k1": res[1],
              "speedup_steps_per_s": res[1]["steps_per_s"] / res[0]["steps_per_s"],
              "buffer_rollouts_per_s": rate}
    print(json.dumps(report, indent=1))
    print(f"trainer steps/s: async k=1 {res[1]['steps_per_s']:.2f} vs sync k=0 "
          f"{res[0]['steps_per_s']:.2f} -> {report['speedup_steps_per_s']:.2f}x (medians)")
    print(f"buffer: {rate:.0f} rollouts/s through one channel; share of step time "
          f"{100 * res[0]['buffer_share']:.2f}% (sync), {100 * res[1]['buffer_share']:.2f}% "
          "(async)")


if __name__ == "__main__":
    main()
