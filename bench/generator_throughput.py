"""Generator throughput inside llamarl vs the same vLLM engine driven standalone.

Both sides run in one invocation on the same machine, one after the other:
  1. llamarl: the recipe through the real launcher (torchrun, trainer + generator ranks) for
     `--steps` steps; per step, tokens generated / generate time, from metrics.jsonl.
  2. standalone: the same `Engine` (same model, settings, prompts, per-step seeds) in a plain
     process with nothing else running; per batch, tokens / generate time.
Reports medians (after `--warmup` steps) and the ratio, plus the llamarl step split into
wait / transfer / train / sync. Usage:

    python bench/generator_throughput.py [--recipe recipes/tiny_grpo_cpu.yaml] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch_logs import torchrun_logs_in_temp

ROOT = Path(__file__).resolve().parents[1]


def run_llamarl(recipe: str, steps: int, out: Path, extra: list[str]) -> Path:
    from llamarl.config import load_config

    cfg = load_config(recipe, extra)
    n = cfg.trainer.ranks + cfg.generator.engines * cfg.generator.tp
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           "-m", "llamarl.launch", recipe, f"run.steps={steps}", "run.eval_every=0",
           f"run.output_dir={out}", "data.eval_prompts=16", *extra]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   stderr=open(out / "llamarl.log", "w"))
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return run


def standalone(recipe: str, steps: int, model_dir: str, extra: list[str]) -> list[dict]:
    """The generator's own prompt loader and seeds, on a lone engine (no trainer, no sync)."""
    from llamarl.config import load_config
    from llamarl.data.dataset import load_prompt_data
    from llamarl.data.loader import PromptLoader, shard
    from llamarl.data.prompts import PromptFormatter
    from llamarl.generator.engine import Engine, sampler_seed

    cfg = load_config(recipe, extra)
    g = cfg.generator
    engine = Engine(model_dir, g, cfg.model.dtype, seed=cfg.run.seed, on_cpu=True)
    fmt = PromptFormatter(engine.tokenizer, cfg.data.chat_template, cfg.data.system_prompt)
    train = fmt.encode(shard(load_prompt_data(cfg.data, cfg.run.seed).train, 0, g.engines))
    loader = PromptLoader(train, cfg.run.seed, 0, g.engines)
    rows = []
    for step in range(steps):
        prompts = loader.next(g.prompts_per_step // g.engines)
        t0 = time.perf_counter()
        groups = engine.generate([p.token_ids for p in prompts], g.samples_per_prompt,
                                 g.temperature, g.max_new_tokens,
                                 seed=sampler_seed(cfg.run.seed, "train", step, 0))
        dt = time.perf_counter() - t0
        rows.append({"tokens": sum(len(c.token_ids) for grp in groups for c in grp), "s": dt})
    return rows


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    torchrun_logs_in_temp()  # (bench/launch_logs.py)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="recipes/tiny_grpo_cpu.yaml")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--standalone-only", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="recipe key=value overrides")
    args = ap.parse_args()
    if args.standalone_only:  # child process: print standalone rows as JSON
        rows = standalone(args.recipe, args.steps, args.standalone_only, args.overrides)
        print("ROWS " + json.dumps(rows))
        return

    out = Path(tempfile.mkdtemp(prefix="llamarl-bench-"))
    run = run_llamarl(args.recipe, args.steps, out, args.overrides)
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    model_dir = json.loads((run / "model.json").read_text())["path"]
    child = subprocess.run([sys.executable, __file__, "--recipe", args.recipe, "--steps",
                            str(args.steps), "--standalone-only", model_dir, *args.overrides],
                           cwd=ROOT, capture_output=True, text=True, check=True,
                           env={**os.environ, "OMP_NUM_THREADS": os.environ.get(
                               "OMP_NUM_THREADS", "1")})
    rows = json.loads(child.stdout.split("ROWS ", 1)[1])

    w = args.warmup
    inside = median([m["tokens_generated"] / m["generate_s"] for m in metrics[w:]])
    alone = median([r["tokens"] / r["s"] for r in rows[w:]])
    split = {k: median([m[k] for m in metrics[w:]]) for k in
             ("step_time_s", "generate_s", "reward_s", "wait_s", "transfer_s", "train_s",
              "sync_s", "other_s")}
    report = {"recipe": args.recipe, "steps": args.steps, "warmup_skipped": w,
              "llamarl_gen_tokens_per_s": inside, "standalone_gen_tokens_per_s": alone,
              "ratio": inside / alone, "step_split_median_s": split, "run_dir": str(run)}
    print(json.dumps(report, indent=1))
    print(f"generator tokens/s: llamarl {inside:.0f} vs standalone {alone:.0f} "
          f"-> {inside / alone:.2f}x (median of {len(metrics) - w} steps)")
    print("step split (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in split.items()))


if __name__ == "__main__":
    main()
