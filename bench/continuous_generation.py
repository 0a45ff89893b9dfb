"""Continuous generation against batch-level asynchronous generation, side by side in one
invocation, on workloads with long-tailed response lengths: batch mode at k = 1 (today's
asynchronous recipe) and k = 2, continuous at k = 2 with sync.prefer_fresh (the default: a
group waits for fresher weights while the trainer has work) and without it, and continuous at
k = 3 (a looser bound on the long tail), and the recommended asynchronous setting: continuous
at k = 3 without prefer_fresh, with IcePop's correction (the GPU recipes'; its learning
is measured by bench/async_quality.py); --modes picks others (k = 3 without prefer_fresh with
AIPO).

Why continuous needs k >= 2: max_staleness bounds the oldest token of a sample, so with k = 1
a group for batch b + 1 may only start once the weights of step b are loaded, which is exactly
when batch mode starts it too; the engine cannot fill batch b's tail with the next batch's
work. With k = 2 it can (generator/continuous.py admits a group when it can still be fresh in
the batch it will land in).

Workloads, on the reverse task's prompts with randomly initialised models (not warm-started):
their responses end at EOS with a probability of a few percent per token, so they run from 1
token to the cap (the longest of a batch is several times the median), as RL responses do.
1 trainer rank + 1 engine (one core each on the 2-core machine), AIPO, packed micro-batches,
the same seed, lr 1e-6: the policy barely moves, so every mode samples the same length
distribution (at lr 1e-4 the random policy's lengths drift differently with each staleness,
by up to 2.5x in 30 steps, and steps/s then compares different work; learning is measured by
bench/async_quality.py).

* `tiny`: the tiny model (2 layers, hidden 128), 64 prompts x 8 samples of up to 100 tokens.
  A decode step of 512 sequences costs in proportion to them (vLLM's per-sequence Python work
  dominates), so a batch's tail of a few long responses is cheap.
* `deep`: 8 layers of the same width, 16 prompts x 4 samples of up to 200 tokens. A decode
  step of 64 sequences is mostly a fixed cost (the layers' ops), as decode steps are on a
  GPU, so a batch's tail costs nearly what its body does: the case continuous mode is for.

Per mode, over the steps after --warmup:

* steps/s: steps / the trainer's total step time;
* generated tokens/s: tokens generated / the total step time;
* engine busy share: batch mode: generate_s / the step time (the engine is busy from the first
  to the last token of a batch, waiting for its longest sample); continuous mode: the share of
  the time it spent in engine calls, stepping and adding requests (engine_busy_share,
  weighted by each batch's wall time), with the shares it spent loading weights (or blocked
  until the weights a batch needs) and
  held back with nothing admissible (engine_load_share, engine_held_share), and, of the busy
  share, stepping while a batch's worth of groups was complete but a running group was due in
  it at its staleness deadline (engine_due_share: the long tail that k does not let the
  engine leave behind); and apart from those, the share it was idle, neither stepping nor
  loading (engine_idle_share = 1 - busy - load: held back, or between engine calls);
* trainer wait: the trainer's mean wait for the next batch (wait_s).

    python bench/continuous_generation.py [--steps 30] [--warmup 5] [--workloads tiny deep]
                                          [--repeats 1] [--modes batch_k1 ...] [key=value ...]

Single invocations vary by up to 15-30% here (batch mode at k = 1 on `deep` has given
0.92-1.43 steps/s): --repeats N interleaves N invocations of every mode and reports medians,
the ratios as the median of each repeat's ratio.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from launch_logs import torchrun_logs_in_temp

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/tiny_grpo_cpu.yaml"
COMMON = ["trainer.ranks=1", "generator.engines=1", "run.eval_every=0", "data.eval_prompts=16",
          "algorithm.correction=aipo", "trainer.lr=1e-6",
          "trainer.max_tokens_per_micro_batch=2048"]
WORKLOADS = {  # name: (model layers, recipe overrides)
    "tiny": (2, ["generator.max_new_tokens=100", "generator.max_model_len=128"]),
    "deep": (8, ["generator.prompts_per_step=16", "generator.samples_per_prompt=4",
                 "generator.max_new_tokens=200", "generator.max_model_len=256"]),
}
MODES = {  # name: (generator.mode, max_staleness, overrides)
    "batch_k1": ("batch", 1, []),
    "batch_k2": ("batch", 2, []),
    "continuous_k2": ("continuous", 2, []),
    "continuous_k2_no_prefer_fresh": ("continuous", 2, ["sync.prefer_fresh=false"]),
    "continuous_k3": ("continuous", 3, []),  # what a looser bound buys against the long tail
    "continuous_k3_no_prefer_fresh": ("continuous", 3, ["sync.prefer_fresh=false"]),
    # the same with IcePop instead of AIPO (the recommended asynchronous setting): held-out
    # reward not below on-policy's (bench/async_quality.py), where AIPO trails at this staleness
    "continuous_k3_no_prefer_fresh_icepop": ("continuous", 3, ["sync.prefer_fresh=false",
                                                               "algorithm.correction=icepop"]),
}
DEFAULT_MODES = [m for m in MODES if m != "continuous_k3_no_prefer_fresh"]


def random_model(layers: int) -> str:
    """The tiny model's architecture with `layers` layers, randomly initialised (2 layers: the
    tiny model's own initialisation), positions up to 512."""
    import torch
    from transformers import Qwen2ForCausalLM

    from llamarl.tiny.model import build_model, save_hf_dir

    path = Path(tempfile.gettempdir()) / f"llamarl-bench-random-{layers}-layers"
    if not (path / "config.json").exists():
        model, tok = build_model(seed=0)
        config = model.config
        config.max_position_embeddings = 512
        if layers != config.num_hidden_layers:
            config.num_hidden_layers = layers
            config.layer_types = ["full_attention"] * layers
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(config)
        save_hf_dir(path, model.state_dict(), config, tok)
    return str(path)


def run(model: str, mode: str, k: int, steps: int, overrides: list[str]) -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix=f"llamarl-bench-{mode}-"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "llamarl.launch", RECIPE, f"run.steps={steps}", f"run.output_dir={out}",
           f"model.path={model}", f"generator.mode={mode}", f"sync.max_staleness={k}",
           *overrides]
    with open(out / "log.txt", "w") as log:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out, ignore_errors=True)
    return rows


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
                    for key in ("engine_load_share", "engine_held_share", "engine_due_share")}
        # neither stepping nor loading weights: held back, or between engine calls
        out["engine_idle_share"] = max(0.0, 1.0 - busy - weighted["engine_load_share"])
        out.update(weighted,
                   spanning_share=statistics.mean(r["spanning_share"] for r in rows),
                   version_spread_mean=statistics.mean(r["version_spread_mean"] for r in rows),
                   in_flight_mean=statistics.mean(r["in_flight_mean"] for r in rows),
                   recomputed_tokens_per_step=statistics.mean(r["recomputed_tokens"]
                                                              for r in rows),
                   stale_groups_discarded=sum(r["stale_groups_discarded"] for r in rows))
    return out


def main() -> None:
    torchrun_logs_in_temp()  # (bench/launch_logs.py)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the totals")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--repeats", type=int, default=1,
                    help="invocations of every mode, interleaved (mode by mode, repeat by "
                         "repeat); the ratios are the medians of the repeats' ratios")
    ap.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES),
                    help="the modes to run (batch_k1, the reference of the ratios, always)")
    ap.add_argument("--out", default="bench/results/continuous_generation.json")
    args, extra = ap.parse_known_args()
    modes = {name: MODES[name] for name in MODES if name in args.modes or name == "batch_k1"}
    result = {"common": COMMON + extra, "steps": args.steps, "warmup": args.warmup,
              "repeats": args.repeats}
    for workload in args.workloads:
        layers, overrides = WORKLOADS[workload]
        model = random_model(layers)
        res = result[workload] = {"overrides": overrides, "layers": layers}
        repeats: dict[str, list[dict]] = {name: [] for name in modes}
        for _ in range(args.repeats):
            for name, (mode, k, mode_overrides) in modes.items():
                rows = run(model, mode, k, args.steps,
                           COMMON + overrides + mode_overrides + extra)
                repeats[name].append(summary(rows[args.warmup:], mode))
                print(workload, name, json.dumps({a: round(v, 4)
                                                  for a, v in repeats[name][-1].items()}),
                      flush=True)
        for name, runs in repeats.items():  # the median of each figure over the repeats
            res[name] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            if args.repeats > 1:
                res[name]["steps_per_s_repeats"] = [r["steps_per_s"] for r in runs]
        for name in [m for m in modes if m.startswith("continuous")]:
            res[f"{name}_over_batch_k1"] = statistics.median(
                c["steps_per_s"] / b["steps_per_s"]
                for c, b in zip(repeats[name], repeats["batch_k1"]))
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
