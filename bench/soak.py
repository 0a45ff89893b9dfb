"""Soak: a long asynchronous run of the tiny recipe, with checkpoints and evaluations, watched
for leaks (issue 17).

Launches `python -m llamarl.launch recipes/tiny_grpo_async_cpu.yaml` (it starts torchrun
itself) for --steps steps, checkpointing every --checkpoint-every, and every --every steps
samples, for every rank (pids from the run's ranks.jsonl) and for the launcher: the resident
set size (VmRSS), the open file descriptors and the threads; and the bytes of the run's
shared-memory segments (/dev/shm/llamarl_<run id>*). Reports each quantity at --from-step and
at the end and its growth between them (goal: under 5%), and writes every sample to
bench/results/soak.json.

    python bench/soak.py                      # make bench-soak: 1000 steps, ~10 min on 2 cores
    python bench/soak.py --steps 200 --from-step 50 --every 25   # a quick look
    python bench/soak.py --recipe recipes/smollm2_add_cpu.yaml --steps 100 --from-step 30 \
        --every 10 --checkpoint-every 50 --out bench/results/soak_smollm2.json
                                              # the real model in bfloat16 (oneDNN's cache)

Also reported: the median step time of the first and the last --every steps after
--from-step (from metrics.jsonl), so a slowdown shows beside a leak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch_logs import torchrun_logs_in_temp

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/tiny_grpo_async_cpu.yaml"


def proc_stats(pid: int) -> dict | None:
    """RSS (MiB), open fds and threads of process `pid`, or None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024, "fds": fds,
            "threads": int(fields["Threads"])}


def shm_bytes(run_id: str) -> int:
    total = 0
    for path in Path("/dev/shm").glob(f"llamarl_{run_id}*"):
        try:
            total += path.stat().st_size
        except FileNotFoundError:
            pass
    return total


def steps_done(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def sample(run: Path, launcher: int) -> dict:
    ranks = [json.loads(x) for x in (run / "ranks.jsonl").read_text().splitlines()]
    procs = {f"rank {r['rank']} ({r.get('role', '')})".replace(" ()", ""): r["pid"]
             for r in ranks}
    procs["launcher"] = launcher
    out = {"step": steps_done(run), "time": time.time(), "shm_bytes": shm_bytes(run_id_of(run))}
    for name, pid in procs.items():
        stats = proc_stats(pid)
        if stats is not None:
            out[name] = stats
    return out


def run_id_of(run: Path) -> str:
    """The run id of a run directory NAME-YYYYmmdd-HHMMSS-xxxxxx: the part after the name."""
    parts = run.name.split("-")
    return "-".join(parts[-3:])


def growth(first: dict, last: dict) -> dict:
    """Per process and quantity: (value at --from-step, value at the end, relative growth)."""
    out = {}
    for name, stats in first.items():
        if not isinstance(stats, dict) or name not in last:
            continue
        for key, a in stats.items():
            b = last[name][key]
            out[f"{name} {key}"] = (a, b, (b - a) / a if a else 0.0)
    # (the batches in flight at that moment: none at all, or one or two of ~60 KiB each)
    a, b = first["shm_bytes"], last["shm_bytes"]
    out["shm_bytes"] = (a, b, (b - a) / a if a else None)
    return out


def step_times(run: Path, start: int, window: int) -> dict:
    """Median step_time_s of the `window` steps after step `start` and of the last `window`
    (trainer rank 0's rows of metrics.jsonl)."""
    import statistics

    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    t = {r["step"]: r["step_time_s"] for r in rows if "step_time_s" in r}
    steps = sorted(t)
    early = [s for s in steps if start < s <= start + window]
    late = steps[-window:]
    return {"early_steps": f"{early[0]}-{early[-1]}",
            "early_s": statistics.median(t[s] for s in early),
            "late_steps": f"{late[0]}-{late[-1]}",
            "late_s": statistics.median(t[s] for s in late)}


def main() -> None:
    torchrun_logs_in_temp()  # (bench/launch_logs.py)
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=50, help="sample every this many steps")
    p.add_argument("--from-step", type=int, default=200, help="growth measured from here")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--out", default="bench/results/soak.json")
    p.add_argument("--recipe", default=RECIPE)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override (repeatable)")
    args = p.parse_args()
    out_dir = Path(tempfile.mkdtemp(prefix="llamarl-soak-"))
    cmd = [sys.executable, "-m", "llamarl.launch", args.recipe, f"run.steps={args.steps}",
           f"run.output_dir={out_dir}", f"run.checkpoint_every={args.checkpoint_every}",
           "run.eval_every=100", *args.set]
    log = open(out_dir / "soak.log", "w")
    job = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    samples, t0, due = [], time.time(), args.every
    try:
        run = None
        while job.poll() is None:
            runs = [d for d in out_dir.iterdir() if d.is_dir()]
            if runs and (runs[0] / "ranks.jsonl").exists():
                run = runs[0]
                if steps_done(run) >= due:
                    due += args.every
                    samples.append(sample(run, job.pid))
                    s = samples[-1]
                    print(f"step {s['step']:5d}  " + "  ".join(
                        f"{k}: {v['rss_mib']:.0f} MiB {v['fds']} fds" for k, v in s.items()
                        if isinstance(v, dict)) + f"  shm {s['shm_bytes'] / 2**20:.1f} MiB",
                        flush=True)
            time.sleep(0.2)
    finally:
        job.kill()
        log.close()
    if job.returncode != 0:
        sys.exit(f"the soak run failed ({job.returncode}):\n"
                 + (out_dir / "soak.log").read_text()[-3000:])
    first = next(s for s in samples if s["step"] >= args.from_step)
    last = samples[-1]
    report = growth(first, last)
    worst = max((g for k, (_, _, g) in report.items() if "rss" in k), default=0.0)
    times = step_times(run, first["step"], args.every)
    result = {"recipe": args.recipe, "overrides": args.set, "steps": args.steps,
              "wall_s": time.time() - t0, "step_time_s": times,
              "from_step": first["step"], "last_step": last["step"],
              "growth": {k: {"from": a, "end": b, "relative": g}
                         for k, (a, b, g) in report.items()},
              "worst_rss_growth": worst, "samples": samples,
              "leftover_shm": sorted(str(x) for x in
                                     Path("/dev/shm").glob(f"llamarl_{run_id_of(run)}*"))}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nfrom step {first['step']} to step {last['step']} (the whole run took "
          f"{result['wall_s']:.0f} s):")
    for k, (a, b, g) in report.items():
        print(f"  {k:40s} {a:12.1f} -> {b:12.1f}  "
              + (f"{100 * g:+6.1f}%" if g is not None else "(in flight)"))
    print(f"median step time, steps {times['early_steps']}: {times['early_s']:.2f} s; steps "
          f"{times['late_steps']}: {times['late_s']:.2f} s")
    print(f"worst RSS growth {100 * worst:+.1f}% (goal: under 5%); shared memory left after "
          f"the run: {len(result['leftover_shm'])} segments")


if __name__ == "__main__":
    main()
