"""On-policy distillation against GRPO from the same start: held-out reward against trainer step
and wall-clock time, one run after the other for each of --seeds, written to --out (JSON).

    python bench/distill.py [--workload tiny|smollm2] [--seeds 0 1 2]
                            [--grpo-steps N] [--distill-steps N] [--eval-every N]
                            [--out bench/results/distill.json]
                            [--grpo-set key=value ...]  # overrides of the GRPO recipe
                            [--algos grpo]       # one side only (a control)
                            [key=value ...]      # overrides of the distillation recipe

Workload tiny (the default; steps 150 / 60, evaluations every 10): GRPO runs
recipes/tiny_grpo_cpu.yaml, distillation recipes/tiny_distill_cpu.yaml: the same student (the
tiny warm start), lengths and prompts; the teacher (tiny-grpo:reverse) is the default recipe's
policy after its 250 steps. Workload smollm2 (steps 30 / 15, evaluations every 5): GRPO runs
recipes/smollm2_add_cpu.yaml, distillation recipes/smollm2_distill_cpu.yaml, both from the base
SmolLM2-135M-Instruct; the teacher (smollm2-grpo:add) is the addition recipe's policy after its
30 steps (seed 0). Either teacher is built and cached by the first distillation run if it is
not cached yet (that run's wall clock then starts after the build: elapsed_s counts from the
first step). The goal (issue 48): distillation reaches GRPO's
final held-out reward in at most a third of GRPO's steps. Reported per seed and as medians over
seeds: GRPO's held-out reward at its last step (the target), the first evaluation step (and
the wall clock of training up to it) at which distillation reaches the seed's target and the
median target, the first steps at which each method reaches THRESHOLDS, and both curves.
`--summarize FILE` recomputes the summary of a results file (with the invocation's
--workload and --grpo-steps), or makes one of the .partial.json an interrupted invocation
leaves (written after every run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from launch_logs import launch_recipe, torchrun_logs_in_temp

ROOT = Path(__file__).resolve().parents[1]
# workload -> (its recipes, GRPO steps, distillation steps, evaluation every)
WORKLOADS = {
    "tiny": ({"grpo": "recipes/tiny_grpo_cpu.yaml", "distill": "recipes/tiny_distill_cpu.yaml"},
             150, 60, 10),
    "smollm2": ({"grpo": "recipes/smollm2_add_cpu.yaml",
                 "distill": "recipes/smollm2_distill_cpu.yaml"}, 30, 15, 5),
}
RECIPES = WORKLOADS["tiny"][0]  # (main() sets the workload's)
THRESHOLDS = (0.5, 0.6, 0.65, 0.7)  # held-out rewards whose first step each method is timed to


def run(algo: str, seed: int, steps: int, eval_every: int, extra: list[str]) -> dict:
    """One launch; its held-out reward at every evaluation with the training wall clock."""
    args = [f"run.steps={steps}", f"run.eval_every={eval_every}", f"run.seed={seed}",
            "run.checkpoint_every=0", *extra]
    run_dir, metrics, evals = launch_recipe(RECIPES[algo], args,
                                            f"llamarl-distill-{algo}-s{seed}-")
    elapsed = {m["step"]: m["elapsed_s"] for m in metrics}
    return {"algo": algo, "seed": seed, "settings": args, "run_dir": str(run_dir),
            "points": [{"step": e["step"], "wall_s": elapsed.get(e["step"], 0.0),
                        "reward_mean": e["reward_mean"],
                        "reward_mean_greedy": e["reward_mean_greedy"]} for e in evals],
            "kl_teacher": [m["kl_teacher"] for m in metrics if "kl_teacher" in m],
            "step_s_median": statistics.median(m["step_time_s"] for m in metrics)}


def first_reaching(points: list[dict], target: float) -> dict | None:
    """The first evaluation at or above `target` (None: never)."""
    return next((p for p in points if p["reward_mean"] >= target - 1e-9), None)


def median_curve(runs: list[dict]) -> list[dict]:
    steps = sorted({p["step"] for r in runs for p in r["points"]})
    out = []
    for s in steps:
        at = [p for r in runs for p in r["points"] if p["step"] == s]
        if len(at) == len(runs):
            out.append({"step": s, "reward_mean": statistics.median(p["reward_mean"] for p in at),
                        "wall_s": statistics.median(p["wall_s"] for p in at)})
    return out


def summarize(runs: list[dict], grpo_steps: int) -> dict:
    grpo = {r["seed"]: r for r in runs if r["algo"] == "grpo"}
    dist = {r["seed"]: r for r in runs if r["algo"] == "distill"}
    target = statistics.median(r["points"][-1]["reward_mean"] for r in grpo.values())
    per_seed = []
    for seed in sorted(grpo.keys() & dist.keys()):
        own = grpo[seed]["points"][-1]
        mine, at_median = (first_reaching(dist[seed]["points"], t)
                           for t in (own["reward_mean"], target))
        per_seed.append({
            "seed": seed, "grpo_final": own["reward_mean"], "grpo_wall_s": own["wall_s"],
            "distill_final": dist[seed]["points"][-1]["reward_mean"],
            "distill_step_to_grpo_final": mine and mine["step"],
            "distill_wall_s_to_grpo_final": mine and mine["wall_s"],
            "distill_step_to_median_target": at_median and at_median["step"]})
    at_target = [s["distill_step_to_median_target"] for s in per_seed]
    reached = [s["distill_step_to_grpo_final"] for s in per_seed]
    walls = [s["distill_wall_s_to_grpo_final"] for s in per_seed]
    steps_median = statistics.median(reached) if all(x is not None for x in reached) else None
    thresholds = {}
    for thr in THRESHOLDS:  # the first evaluation at or above thr, median over seeds
        firsts = {}
        for algo, by_seed in (("grpo", grpo), ("distill", dist)):
            hits = [first_reaching(r["points"], thr) for r in by_seed.values()]
            firsts[algo] = (None if any(h is None for h in hits) else
                            {"step": statistics.median(h["step"] for h in hits),
                             "wall_s": statistics.median(h["wall_s"] for h in hits)})
        g, d = firsts["grpo"], firsts["distill"]
        thresholds[str(thr)] = dict(firsts, step_ratio=d["step"] / g["step"] if g and d else None,
                                    wall_ratio=d["wall_s"] / g["wall_s"] if g and d else None)
    return {
        "grpo_steps": grpo_steps, "target_median_grpo_final": target,
        "thresholds": thresholds,
        "per_seed": per_seed,
        "distill_steps_to_grpo_final_median": steps_median,
        "distill_wall_s_to_grpo_final_median": (statistics.median(walls)
                                                if all(w is not None for w in walls) else None),
        "grpo_wall_s_median": statistics.median(r["points"][-1]["wall_s"]
                                                for r in grpo.values()),
        "step_ratio": steps_median / grpo_steps if steps_median is not None else None,
        "goal_met": steps_median is not None and steps_median <= grpo_steps / 3,
        # the same against the median of GRPO's finals (one target for every seed)
        "distill_steps_to_median_target_median": (statistics.median(at_target) if all(
            x is not None for x in at_target) else None),
        "curves": {"grpo": median_curve(list(grpo.values())),
                   "distill": median_curve(list(dist.values()))},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny")
    ap.add_argument("--grpo-steps", type=int, help="default: the workload's")
    ap.add_argument("--distill-steps", type=int, help="default: the workload's")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--eval-every", type=int, help="default: the workload's")
    ap.add_argument("--out", help="default: bench/results/distill.json (tiny), "
                                  "distill_smollm2.json (smollm2)")
    ap.add_argument("--grpo-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an override of the GRPO recipe (repeatable), e.g. a control with the "
                         "distillation's algorithm.mini_batches")
    ap.add_argument("overrides", nargs="*", help="key=value for the distillation recipe")
    ap.add_argument("--algos", nargs="+", default=["distill", "grpo"],
                    choices=["distill", "grpo"], help="run only these (a control of one side)")
    ap.add_argument("--summarize", metavar="JSON",
                    help="recompute the summary of the runs of a results file, running nothing")
    args = ap.parse_args()
    global RECIPES
    RECIPES, grpo_steps, distill_steps, eval_every = WORKLOADS[args.workload]
    args.grpo_steps = args.grpo_steps or grpo_steps
    args.distill_steps = args.distill_steps or distill_steps
    args.eval_every = args.eval_every or eval_every
    args.out = args.out or str(ROOT / "bench" / "results" / (
        "distill.json" if args.workload == "tiny" else f"distill_{args.workload}.json"))
    if args.summarize:
        result = json.loads(Path(args.summarize).read_text())  # (or a .partial.json)
        result["summary"] = summarize(result["runs"], args.grpo_steps)
        Path(args.summarize).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({k: v for k, v in result["summary"].items() if k != "curves"},
                         indent=1))
        return 0
    torchrun_logs_in_temp()
    runs = []
    for seed in args.seeds:
        for algo, steps, extra in (("distill", args.distill_steps, args.overrides),
                                   ("grpo", args.grpo_steps, args.grpo_set)):
            if algo not in args.algos:
                continue
            r = run(algo, seed, steps, args.eval_every, extra)
            runs.append(r)
            print(f"{algo} seed {seed}: held-out "
                  + " ".join(f"{p['step']}:{p['reward_mean']:.3f}" for p in r["points"])
                  + f" (step {r['step_s_median']:.2f} s)", flush=True)
            # after every run, so that an interrupted invocation keeps what it ran
            partial = Path(args.out).with_suffix(".partial.json")
            partial.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    if set(args.algos) != set(RECIPES):  # one side only: its curves, no comparison
        result = {"summary": {"grpo_steps": args.grpo_steps, "curves": {
            a: median_curve([r for r in runs if r["algo"] == a]) for a in args.algos}},
            "runs": runs}
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        partial.unlink(missing_ok=True)
        return 0
    result = {"summary": summarize(runs, args.grpo_steps), "runs": runs}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    partial.unlink(missing_ok=True)
    s = result["summary"]
    print(f"GRPO final held-out (median over seeds, step {args.grpo_steps}): "
          f"{s['target_median_grpo_final']:.3f}; distillation reaches each seed's in "
          f"{s['distill_steps_to_grpo_final_median']} steps (median), "
          f"{s['distill_wall_s_to_grpo_final_median']} s against GRPO's "
          f"{s['grpo_wall_s_median']:.0f} s; goal met: {s['goal_met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
