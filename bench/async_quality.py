"""Does asynchronous training learn as well as synchronous? Runs the default recipe with
max_staleness k = 0, 1 and 2 (k >= 1 with LlamaRL's AIPO correction) for the same number of
trainer steps, one after the other, and writes the held-out reward against trainer step and
against wall-clock time: `async_quality.csv`, `async_quality.json` and (with matplotlib)
`async_quality.png` in --out.

    python bench/async_quality.py [--steps 150] [--out bench/results] [key=value ...]
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/tiny_grpo_cpu.yaml"


def run(k: int, steps: int, eval_every: int, extra: list[str]) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"llamarl-quality-k{k}-"))
    args = [RECIPE, f"run.steps={steps}", f"run.eval_every={eval_every}",
            f"sync.max_staleness={k}", f"run.output_dir={out}", *extra]
    if k > 0:
        args.append("algorithm.correction=aipo")
    cmd = [sys.executable, "-m", "llamarl.launch", *args]
    with open(out / "log.txt", "w") as log:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    elapsed = {m["step"]: m["elapsed_s"] for m in metrics}
    points = [{"k": k, "step": e["step"], "wall_s": elapsed.get(e["step"], 0.0),
               "reward_mean": e["reward_mean"], "reward_mean_greedy": e["reward_mean_greedy"]}
              for e in evals]
    return {"k": k, "run_dir": str(run_dir), "points": points,
            "train_reward_last20": sum(m["reward_mean"] for m in metrics[-20:]) / 20,
            "wall_s": metrics[-1]["elapsed_s"]}


def plot(results: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        label = f"k={r['k']}" + (" (AIPO)" if r["k"] else " (sync)")
        xs = [p["step"] for p in r["points"]]
        ws = [p["wall_s"] for p in r["points"]]
        ys = [p["reward_mean"] for p in r["points"]]
        axes[0].plot(xs, ys, marker="o", label=label)
        axes[1].plot(ws, ys, marker="o", label=label)
    axes[0].set_xlabel("trainer step")
    axes[1].set_xlabel("wall clock since the first step (s)")
    for ax in axes:
        ax.set_ylabel("held-out reward (sampled)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("tiny GRPO on CPU: synchronous vs bounded-staleness asynchronous")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [run(k, args.steps, args.eval_every, args.overrides) for k in (0, 1, 2)]
    with open(out / "async_quality.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["k", "step", "wall_s", "reward_mean",
                                          "reward_mean_greedy"])
        w.writeheader()
        for r in results:
            w.writerows(r["points"])
    (out / "async_quality.json").write_text(json.dumps(results, indent=1))
    drew = plot(results, out / "async_quality.png")
    for r in results:
        first, last = r["points"][0], r["points"][-1]
        print(f"k={r['k']}: held-out reward {first['reward_mean']:.3f} -> "
              f"{last['reward_mean']:.3f} after {last['step']} steps in {r['wall_s']:.0f} s "
              f"(greedy {last['reward_mean_greedy']:.3f})")
    print(f"curves: {out / 'async_quality.csv'}" + (f", {out / 'async_quality.png'}" if drew
                                                     else " (install matplotlib for a PNG)"))


if __name__ == "__main__":
    main()
