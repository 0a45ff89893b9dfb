"""RL through the Tinker service: examples/tinker_rl_loop.py (the SDK alone) against a llamarl
service on SmolLM2-135M-Instruct, held-out reward per evaluation for each of --seeds, beside
the recipe loop's own LoRA runs on the same task (recipes/smollm2_add_cpu.yaml, the rank-8
runs of bench/results/lora_smollm2_tuned_3seeds.json: same prompts, same held-out set, same
16 prompts x 8 samples x 32 tokens per step).

    python bench/service_rl.py [--seeds 0 1] [--steps 30] [--eval-every 5]
                               [--rank 8] [--lr 8e-4]

Per seed: a server in this process (recipes/serve_smollm2_cpu.yaml; sampling with the
adapter merged into the engine, the CPU default), the example as a client process, its JSON
lines kept. The summary: per seed the first evaluated step whose held-out reward reaches 0.5,
the final reward and the median step time; the same for the reference runs.

Differences from the recipe loop that remain: Tinker's importance_sampling is a per-token sum
(the recipe's GRPO a token mean, with its clipping), the example's advantages are
reward - group mean (no division by the group's std), and its groups with equal rewards are
dropped rather than kept with zero advantage.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

from harness import ROOT, bench_parser, median, write_result

sys.path.insert(0, str(ROOT))
REFERENCE = ROOT / "bench/results/lora_smollm2_tuned_3seeds.json"


def first_at(points: list[tuple[int, float]], level: float = 0.5) -> int | None:
    return next((step for step, r in points if r >= level), None)


def run_seed(seed: int, args) -> list[dict]:
    from llamarl.service.server import start

    served = start("recipes/serve_smollm2_cpu.yaml",
                   ["service.port=0", f"service.dir={args.dir}/s{seed}", f"run.seed={seed}"])
    thread = threading.Thread(target=served.serve, daemon=True)
    thread.start()
    try:
        cmd = [sys.executable, "examples/tinker_rl_loop.py", "--base-url", served.url,
               "--seed", str(seed), "--steps", str(args.steps), "--eval-every",
               str(args.eval_every), "--rank", str(args.rank), "--lr", str(args.lr)]
        rows = []
        with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True) as proc:
            for line in proc.stdout:
                if line.startswith("{"):
                    rows.append(json.loads(line))
                    print(f"seed {seed}: {line.strip()}", flush=True)
        if proc.returncode != 0:
            raise SystemExit(f"the example failed (exit {proc.returncode}) on seed {seed}")
        return rows
    finally:
        served.stop()
        thread.join(60)


def reference() -> list[dict]:
    runs = json.loads(REFERENCE.read_text())["runs"]
    return [{"seed": r["seed"], "points": [(p["step"], p["reward_mean"]) for p in r["points"]],
             "step_s_median": r["step_s_median"]} for r in runs if r["config"] == "r8"]


def main() -> None:
    ap = bench_parser("service_rl", __doc__)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=8e-4)
    ap.add_argument("--dir", default="/tmp/llamarl-bench-service-rl")
    args = ap.parse_args()
    runs = []
    for seed in args.seeds:
        t0 = time.time()
        rows = run_seed(seed, args)
        points = [(r["step"], r["held_out"]) for r in rows if "held_out" in r]
        times = [b["time_s"] - a["time_s"] for a, b in zip(rows, rows[1:])]
        runs.append({"seed": seed, "rows": rows, "points": points,
                     "first_step_at_0.5": first_at(points),
                     "final_held_out": points[-1][1] if points else None,
                     "step_s_median": median(times), "wall_s": round(time.time() - t0, 1)})
    ref = reference()
    summary = {
        "service": [{k: r[k] for k in ("seed", "points", "first_step_at_0.5", "final_held_out",
                                       "step_s_median")} for r in runs],
        "recipe_lora_r8": [{"seed": r["seed"], "points": r["points"],
                            "first_step_at_0.5": first_at(r["points"]),
                            "step_s_median": round(r["step_s_median"], 1)} for r in ref]}
    print(json.dumps(summary, indent=1))
    write_result("service_rl", {"runs": runs, "summary": summary}, args)


if __name__ == "__main__":
    main()
