"""Does a tensor-parallel engine train as well as a one-rank engine? Runs the default recipe
(one engine of tp 1) and recipes/tiny_grpo_tp2_cpu.yaml (the same run with one engine of tp 2)
for each of --seeds, one run after the other, and writes the final held-out reward of each run,
the per-seed gap tp2 - tp1 with its standard error, and the seed-to-seed std of tp1 (the noise
the gap is measured against) to tp_quality.json in --out.

    python bench/tp_quality.py [--steps 250] [--seeds 0 1 2] [--out bench/results] [key=value]

Runs of one seed share the initial model, the prompt order and the sampler seeds; only the
engine's layout differs. A tp 2 engine sums each layer's two halves in an all-reduce, so its
logits differ from tp 1's in the last float bits, and a sample drawn at a near-tie can flip:
the two runs drift apart, as runs of two seeds do, but more slowly.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_quality import run  # noqa: E402  (bench/ is not a package)

RECIPES = {"tp1": "recipes/tiny_grpo_cpu.yaml", "tp2": "recipes/tiny_grpo_tp2_cpu.yaml"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("overrides", nargs="*", help="recipe key=value for every run")
    args = ap.parse_args()
    results = []
    for seed in args.seeds:
        for name, recipe in RECIPES.items():
            r = run(0, seed, "none", args.steps, args.eval_every, args.overrides, recipe=recipe)
            r["layout"] = name
            results.append(r)
            print(f"seed {seed} {name}: held-out reward {r['points'][-1]['reward_mean']:.3f} "
                  f"(greedy {r['points'][-1]['reward_mean_greedy']:.3f}), "
                  f"{r['wall_s']:.0f} s, mismatch KL median {r['mismatch_kl_median']:.1e}",
                  flush=True)
    final = {(r["layout"], r["seed"]): r["points"][-1]["reward_mean"] for r in results}
    gaps = [final["tp2", s] - final["tp1", s] for s in args.seeds]
    summary = {"steps": args.steps, "seeds": args.seeds, "overrides": args.overrides,
               "final_reward": {f"{k}/seed{s}": v for (k, s), v in final.items()},
               "gap_mean": statistics.mean(gaps),
               "gap_se": statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else None,
               "tp1_seed_std": statistics.stdev(final["tp1", s] for s in args.seeds)
               if len(gaps) > 1 else None,
               "wall_s": {f"{r['layout']}/seed{r['seed']}": r["wall_s"] for r in results},
               "runs": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tp_quality.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
