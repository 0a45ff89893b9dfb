"""`python -m llamarl.plot RUN_DIR [--steps N]`: charts of a run, written to RUN_DIR/plots/.

  reward.png              training reward, held-out reward (sampled and greedy), the KL to
                          the reference policy (when the run has one) and the behaviour/trainer
                          mismatch KL against trainer step
  timeline.png            per-rank phases (generate, reward, put, load_weights, eval;
                          wait_rollouts, reward_model, train, sync, checkpoint) over the last
                          N trainer steps of the latest launch: overlap between generators and
                          trainers, and idle gaps (white)
  timeline.trace.json     the whole timeline in Chrome trace format (chrome://tracing, Perfetto)

It also prints each rank's busy share over the run. A resumed run repeats the steps after its
last checkpoint; the charts keep the latest row of each step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llamarl import timeline

COLORS = {"generate": "#4C72B0", "reward": "#8172B2", "put": "#64B5CD", "load_weights": "#55A868",
          "eval": "#CCB974", "wait_rollouts": "#DDDDDD", "train": "#C44E52", "sync": "#DD8452",
          "checkpoint": "#937860", "reward_model": "#B07AA1"}


def chrome_trace(events: list[dict]) -> dict:
    """Chrome trace format: one complete ("X") event per phase, microseconds from the first
    event; one track (tid) per rank, named and ordered by rank."""
    t0 = min(e["start"] for e in events)
    ranks = sorted({(e["rank"], e["role"]) for e in events})
    return {"traceEvents": [
        {"name": e["phase"], "ph": "X", "pid": 0, "tid": e["rank"],
         "ts": (e["start"] - t0) * 1e6, "dur": (e["end"] - e["start"]) * 1e6,
         "args": {"step": e["step"], "role": e["role"]}} for e in events] + [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"{r}: {role}"}}
        for r, role in ranks] + [
        {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r, "args": {"sort_index": r}}
        for r, _ in ranks], "displayTimeUnit": "ms"}


def latest_per_step(rows: list[dict]) -> list[dict]:
    """One row per step, the last written: a resumed run re-runs the steps after its last
    checkpoint and appends their rows again."""
    return sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])


def kl_panels(metrics: list[dict]) -> list[tuple[str, list[float]]]:
    """(y label, per-step values) of each KL chart: the reverse KL to the teacher when the run
    distils (algorithm.name = on_policy_distill), the KL to the reference policy when the run
    has one (algorithm.kl_coef > 0 makes it non-zero), then the mismatch KL."""
    panels = []
    if any("kl_teacher" in m for m in metrics):
        panels.append(("reverse KL to the teacher, per token",
                       [m.get("kl_teacher", 0.0) for m in metrics]))
    if any(m.get("kl_ref", 0.0) for m in metrics):
        panels.append(("KL to the reference policy, per token",
                       [m["kl_ref"] for m in metrics]))
    panels.append(("mismatch KL (behaviour || trainer), per token",
                   [m.get("mismatch_kl", 0.0) for m in metrics]))
    return panels


def busy_share(events: list[dict]) -> dict[str, float]:
    """Per rank: fraction of its wall time inside a working phase (waiting excluded)."""
    out = {}
    for rank in sorted({e["rank"] for e in events}):
        mine = [e for e in events if e["rank"] == rank]
        span = max(e["end"] for e in mine) - min(e["start"] for e in mine)
        busy = sum(e["end"] - e["start"] for e in mine if e["phase"] != "wait_rollouts")
        out[f"rank {rank} ({mine[0]['role']})"] = busy / span if span > 0 else 0.0
    return out


def plot_rewards(run_dir: Path, out: Path, plt) -> None:
    metrics = latest_per_step(timeline.read_jsonl(run_dir / "metrics.jsonl"))
    evals_path = run_dir / "eval.jsonl"
    evals = latest_per_step(timeline.read_jsonl(evals_path)) if evals_path.exists() else []
    panels = kl_panels(metrics)
    fig, (ax, *kxs) = plt.subplots(1, 1 + len(panels), figsize=(5.5 * (1 + len(panels)), 4))
    ax.plot([m["step"] for m in metrics], [m["reward_mean"] for m in metrics], lw=1,
            alpha=0.6, label="training batch")
    if evals:
        ax.plot([e["step"] for e in evals], [e["reward_mean"] for e in evals], marker="o",
                label="held-out (sampled)")
        ax.plot([e["step"] for e in evals], [e["reward_mean_greedy"] for e in evals],
                marker="s", label="held-out (greedy)")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward")
    ax.legend()
    ax.grid(alpha=0.3)
    for kx, (label, values) in zip(kxs, panels):
        kx.plot([m["step"] for m in metrics], values)
        kx.set_xlabel("trainer step")
        kx.set_ylabel(label)
        kx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "reward.png", dpi=110)
    plt.close(fig)


def trainer_window(events: list[dict], steps: int) -> tuple[float, float, int]:
    """(start, end, number of steps) of the last `steps` trainer steps of the latest launch,
    seen on the first trainer rank. A resumed run's timeline also holds its earlier launches:
    going back in time, a step number that does not fall marks one."""
    trains = sorted((e for e in events if e["phase"] == "train"), key=lambda e: e["start"])
    if not trains:
        return min(e["start"] for e in events), max(e["end"] for e in events), 0
    rank = min(e["rank"] for e in trains)
    mine = [e for e in trains if e["rank"] == rank]
    picked = [mine[-1]]
    for e in reversed(mine[:-1]):
        if len(picked) == steps or e["step"] >= picked[-1]["step"]:
            break
        picked.append(e)
    first = picked[-1]
    waits = [e["start"] for e in events if e["rank"] == rank and e["phase"] == "wait_rollouts"
             and e["step"] == first["step"] and e["start"] <= first["start"]]
    hi = max(e["end"] for e in events if e["rank"] == rank)
    return max(waits, default=first["start"]), hi, len(picked)


def plot_timeline(events: list[dict], steps: int, out: Path, plt) -> None:
    lo, hi, n_steps = trainer_window(events, steps)
    shown = [e for e in events if e["end"] >= lo and e["start"] <= hi]
    ranks = sorted({(e["rank"], e["role"]) for e in events})
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.6 * len(ranks)))
    for y, (rank, _) in enumerate(ranks):
        for e in (x for x in shown if x["rank"] == rank):
            ax.barh(y, e["end"] - e["start"], left=e["start"] - lo, height=0.6,
                    color=COLORS.get(e["phase"], "#999999"), edgecolor="none")
    ax.set_yticks(range(len(ranks)), [f"rank {r}: {role}" for r, role in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, hi - lo)
    ax.set_xlabel(f"seconds (last {n_steps} trainer steps)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, COLORS.keys(), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("phases per rank (white = idle)")
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llamarl.plot", description=__doc__)
    ap.add_argument("run_dir")
    ap.add_argument("--steps", type=int, default=6, help="trainer steps in timeline.png")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: must be at least 1")
    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics.jsonl").exists():
        print(f"llamarl.plot: {run_dir} has no metrics.jsonl: pass a run directory",
              file=sys.stderr)
        return 2
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    events = timeline.read(run_dir)
    if events:
        (out / "timeline.trace.json").write_text(json.dumps(chrome_trace(events)))
        for rank, share in busy_share(events).items():
            print(f"{rank}: busy {100 * share:.0f}% of the run")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("llamarl.plot: matplotlib is not installed (pip install matplotlib); wrote only "
              f"{out / 'timeline.trace.json'}", file=sys.stderr)
        return 1
    plot_rewards(run_dir, out, plt)
    if events:
        plot_timeline(events, args.steps, out, plt)
    print(f"charts in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
