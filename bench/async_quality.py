"""Does asynchronous training learn as well as synchronous? Runs the default recipe with
max_staleness k = 0, 1 and 2 (k >= 1 with the --correction off-policy correction) for the same
number of trainer steps, for each of --seeds, one run after the other, and writes the held-out
reward against trainer step and against wall-clock time: `async_quality.csv`,
`async_quality.json` and (with matplotlib) `async_quality.png` (mean over seeds) in --out.

    python bench/async_quality.py [--steps 250] [--seeds 0 1 2 3] [--correction none]
                                  [--lr 3e-4] [--ks 0 1 2] [--eval-samples 16] [key=value]
                                  [--modes batch continuous]  # generator.mode of k >= 1
    python bench/async_quality.py --merge DIR [DIR ...] --out DIR   # runs made separately

Runs of the same seed share the initial model and the prompt order, so the bench reports
the gap k - sync per seed (paired) with its standard error, next to the seed-to-seed std of
sync: the noise a gap is measured against. `--correction none` is PPO's clipped objective
with the ratio taken against the behaviour policy (see llamarl/algorithms/policy_loss.py).

The learning rate sets how far one optimizer step moves the policy, which is what staleness
costs: at the default recipe's lr 1e-3 one step moves the tiny model by a mismatch KL of
~0.02-0.04 nats/token, far more than LLM RL steps do, and single runs scatter by +-0.04; at
3e-4 (~0.002 per step, ~0.005 over two) k = 1 matches sync and k = 2 trails by ~0.02; at
1.5e-4 (~0.0015 over two steps) k = 2 matches sync (+0.002 +- 0.003 over 4 seeds). The
comparison runs at --lr for every k.

With sync.prefer_fresh (the default) a k = 2 generator that is faster than the trainer waits
for fresh weights while its last batch is queued, so here it samples exactly as k = 1 does
(staleness used 0.98, the same run step for step). Pass sync.prefer_fresh=false to measure
samples that really are k versions old: such runs are reported as the series "k=2, k ahead".
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from launch_logs import torchrun_logs_in_temp

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/tiny_grpo_cpu.yaml"


# what each algorithm.correction does to a stale sample, for the plot's legend
CORRECTIONS = {"none": "PPO-clipped ratio to the behaviour policy", "tis": "truncated IS",
               "aipo": "AIPO", "icepop": "IcePop"}


def run(k: int, seed: int, correction: str, steps: int, eval_every: int,
        extra: list[str], mode: str = "batch", recipe: str = RECIPE) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"llamarl-quality-k{k}-s{seed}-"))
    args = [recipe, f"run.steps={steps}", f"run.eval_every={eval_every}", f"run.seed={seed}",
            f"sync.max_staleness={k}", f"run.output_dir={out}", *extra]
    if k > 0:
        args.append(f"algorithm.correction={correction}")
        if mode != "batch":
            args.append(f"generator.mode={mode}")
    cmd = [sys.executable, "-m", "llamarl.launch", *args]
    with open(out / "log.txt", "w") as log:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    elapsed = {m["step"]: m["elapsed_s"] for m in metrics}
    points = [{"k": k, "seed": seed, "step": e["step"], "wall_s": elapsed.get(e["step"], 0.0),
               "reward_mean": e["reward_mean"], "reward_mean_greedy": e["reward_mean_greedy"]}
              for e in evals]
    return {"k": k, "seed": seed, "run_dir": str(run_dir), "points": points,
            "settings": args[1:],  # the recipe overrides of this run
            "mismatch_kl_median": statistics.median(m["mismatch_kl"] for m in metrics),
            "staleness_mean": statistics.mean(m["staleness_mean"] for m in metrics),
            "train_reward_last20": sum(m["reward_mean"] for m in metrics[-20:]) / 20,
            "wall_s": metrics[-1]["elapsed_s"]}


def series(r: dict) -> str:
    """The curve a run belongs to: its k and, for k >= 2 (the only runs it changes), whether
    the generators waited for fresh weights while a batch was queued (sync.prefer_fresh, the
    default) or ran k versions ahead (sync.prefer_fresh=false)."""
    name = f"k={r['k']}"
    if r["k"] >= 2 and "sync.prefer_fresh=false" in r.get("settings", []):
        name += ", k ahead"
    if "generator.mode=continuous" in r.get("settings", []):
        name += ", continuous"
    return name


def mean_curves(results: list[dict]) -> dict[str, list[dict]]:
    """Per series: the held-out reward and wall clock at each eval step, averaged over seeds."""
    out = {}
    for name in sorted({series(r) for r in results}):
        runs = [r["points"] for r in results if series(r) == name]
        out[name] = [{"step": pts[0]["step"],
                   "wall_s": sum(p["wall_s"] for p in pts) / len(pts),
                   "reward_mean": sum(p["reward_mean"] for p in pts) / len(pts),
                   "spread": max(p["reward_mean"] for p in pts) -
                   min(p["reward_mean"] for p in pts),
                   "se": statistics.stdev(p["reward_mean"] for p in pts) / len(pts) ** 0.5
                   if len(pts) > 1 else 0.0}
                  for pts in zip(*runs)]
    return out


def paired_gaps(results: list[dict]) -> dict[str, dict]:
    """Per series with k > 0: the final held-out reward minus k = 0's in the same seed (same
    initial model and prompts), averaged over seeds, with its standard error; and the
    seed-to-seed standard deviation of k = 0's final reward (the noise a gap is measured
    against)."""
    final = {(series(r), r["seed"]): r["points"][-1]["reward_mean"] for r in results}
    sync = [v for (name, _), v in final.items() if name == "k=0"]
    out = {}
    for name in sorted({name for name, _ in final if name != "k=0"}):
        gaps = [final[name, s] - final["k=0", s] for n, s in final
                if n == name and ("k=0", s) in final]
        if len(gaps) < 2:
            continue
        mean = statistics.mean(gaps)
        out[name] = {"gap_mean": mean, "gap_se": statistics.stdev(gaps) / len(gaps) ** 0.5,
                  "seeds": len(gaps), "sync_seed_std": statistics.stdev(sync)}
    return out


def plot(results: list[dict], label: str, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for i, (name, pts) in enumerate(mean_curves(results).items()):
        used = [r["staleness_mean"] for r in results
                if series(r) == name and "staleness_mean" in r]
        name += " (sync)" if name == "k=0" else \
            f" (staleness used {statistics.mean(used):.2f})" if used else ""
        xs = [p["step"] for p in pts]
        ws = [p["wall_s"] for p in pts]
        ys = [p["reward_mean"] for p in pts]
        se = [p["se"] for p in pts]
        # dashed and with open markers in turn: identical curves stay visible
        style = dict(marker="os^D"[i % 4], capsize=3, label=name, linestyle="-" if i % 2 == 0
                     else "--", fillstyle="full" if i % 2 == 0 else "none")
        axes[0].errorbar(xs, ys, yerr=se, **style)
        axes[1].errorbar(ws, ys, yerr=se, **style)
    axes[0].set_xlabel("trainer step")
    axes[1].set_xlabel("wall clock since the first step (s)")
    for ax in axes:
        ax.set_ylabel("held-out reward, mean +- s.e. over seeds")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    fig.suptitle("tiny GRPO on CPU: synchronous vs bounded-staleness asynchronous\n"
                 f"(k >= 1 corrected by: {label})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    torchrun_logs_in_temp()  # (bench/launch_logs.py)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=RECIPE, help="e.g. recipes/tiny_tool_cpu.yaml "
                    "(multi-turn); every run uses it")
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--lr", type=float, default=3e-4, help="trainer.lr of every run")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--correction", default="none", choices=["none", "aipo", "tis", "icepop"],
                    help="algorithm.correction of the k >= 1 runs (k = 0 runs none)")
    ap.add_argument("--eval-samples", type=int, default=16,
                    help="data.eval_samples_per_prompt: 128 prompts x 16 samples per eval")
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2], help="max_staleness values")
    ap.add_argument("--modes", nargs="+", default=["batch"], choices=["batch", "continuous"],
                    help="generator.mode of the k >= 1 runs (k = 0 runs batch)")
    ap.add_argument("--merge", nargs="+", default=[], metavar="DIR",
                    help="run nothing: report the runs saved in these --out folders together")
    ap.add_argument("overrides", nargs="*", help="recipe overrides, key=value, anywhere")
    # key=value arguments are recipe overrides wherever they stand (after `--ks 0 1 2`
    # argparse alone would take them for more ks)
    argv = sys.argv[1:]
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    args = ap.parse_args([a for a in argv if a not in overrides])
    args.overrides = overrides
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        results = [r for d in args.merge
                   for r in json.loads((Path(d) / "async_quality.json").read_text())]
        results.sort(key=lambda r: (r["seed"], r["k"]))
    else:
        extra = [f"trainer.lr={args.lr}",
                 f"data.eval_samples_per_prompt={args.eval_samples}", *args.overrides]
        results = [run(k, s, args.correction, args.steps, args.eval_every, extra, mode,
                       args.recipe)
                   for s in args.seeds for k in args.ks
                   for mode in (args.modes if k > 0 else ["batch"])]
    with open(out / "async_quality.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["k", "seed", "step", "wall_s", "reward_mean",
                                          "reward_mean_greedy"])
        w.writeheader()
        for r in results:
            w.writerows(r["points"])
    (out / "async_quality.json").write_text(json.dumps(results, indent=1))
    corrections = sorted({a.split("=", 1)[1] for r in results if r["k"]
                          for a in r.get("settings", []) if a.startswith("algorithm.corr")})
    drew = plot(results, ", ".join(CORRECTIONS.get(c, c) for c in corrections or [args.correction]),
                out / "async_quality.png")
    for r in results:
        first, last = r["points"][0], r["points"][-1]
        used = (f", staleness used {r['staleness_mean']:.2f}, mismatch KL "
                f"{r['mismatch_kl_median']:.4f}" if "staleness_mean" in r else "")
        print(f"{series(r)} seed {r['seed']}: held-out reward {first['reward_mean']:.3f} -> "
              f"{last['reward_mean']:.3f} after {last['step']} steps in {r['wall_s']:.0f} s "
              f"(greedy {last['reward_mean_greedy']:.3f}{used})")
    for name, pts in mean_curves(results).items():
        print(f"{name}: mean held-out reward after {pts[-1]['step']} steps "
              f"{pts[-1]['reward_mean']:.3f} (spread over seeds {pts[-1]['spread']:.3f}), "
              f"mean wall clock {pts[-1]['wall_s']:.0f} s")
    gaps = paired_gaps(results)
    for name, g in gaps.items():
        print(f"{name} minus k=0, same seed, final held-out reward: {g['gap_mean']:+.3f} "
              f"+- {g['gap_se']:.3f} (standard error over {g['seeds']} seeds; the seed-to-seed "
              f"std of k=0 is {g['sync_seed_std']:.3f})")
    (out / "async_quality_gaps.json").write_text(json.dumps(gaps, indent=1))
    print(f"curves: {out / 'async_quality.csv'}" + (f", {out / 'async_quality.png'}" if drew
                                                     else " (install matplotlib for a PNG)"))


if __name__ == "__main__":
    main()
