"""How busy the engine stays while episodes wait for tools: the tiny lookup task's episodes
(multi-turn source, real vLLM engine, environment worker processes) with a lookup tool that
sleeps a random 0-50 ms (a remote call), against the same tool without the sleep.

engine_busy_share = time inside engine steps / time of the whole collection; env_wait_share =
time blocked waiting for environments with no sequence to step; the rest is the runner's own
work (environment round trips, tokenising observations, submitting requests). An episode
waiting for a tool never holds the others. Medians over --repeats collections of --prompts x
--samples episodes.

    python bench/multi_turn_concurrency.py     (builds the tiny lookup warm start if needed)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from llamarl.envs.lookup import LookupEnv


class SlowLookupEnv(LookupEnv):
    def lookup(self, key: str) -> str:
        time.sleep(random.uniform(0.0, 0.05))
        return super().lookup(key)


def main() -> None:
    import torch

    from llamarl.config import load_config
    from llamarl.data.prompts import PromptFormatter
    from llamarl.generator.engine import Engine
    from llamarl.models.tiny import warm_start_dir
    from llamarl.rollout.source import SourceContext, build_source
    from llamarl.tiny import lookup
    from llamarl.trainer.warmstart import run_warm_start

    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="", help="a trained policy directory (default: the "
                    "lookup warm start, which calls the tool in about 0.4 of 1 episode)")
    ap.add_argument("--out", default="bench/results/multi_turn_concurrency.json")
    args = ap.parse_args()
    path = Path(args.model) if args.model else warm_start_dir("lookup")
    if not (path / "config.json").is_file():
        run_warm_start("lookup", path, None, torch.device("cpu"))
    result = {"model": "lookup warm start" if not args.model else args.model,
              "episodes_per_collection": args.prompts * args.samples, "repeats": args.repeats}
    engine = None
    for name, env in (("instant_tool", "lookup"),
                      ("tool_sleeps_0_50ms", "multi_turn_concurrency:SlowLookupEnv")):
        cfg = load_config("recipes/tiny_tool_cpu.yaml", [f"rollout.env={env}"])
        if engine is None:
            engine = Engine(str(path), cfg.generator, "float32", 0, True,
                            sequences=args.prompts * args.samples)
        fmt = PromptFormatter(engine.tokenizer)
        source = build_source(SourceContext(cfg, engine, engine.tokenizer, fmt, None, 0))
        prompts = fmt.encode(lookup.sample_examples(args.prompts, "train", 0))
        runs = []
        try:
            for r in range(args.repeats + 1):
                got = source.collect(prompts, args.samples, 1.0, 1000 + r, 0, step=r)
                if r:  # the first is a warm-up
                    runs.append(got.metrics)
        finally:
            source.close()
        result[name] = {
            "engine_busy_share": round(statistics.median(
                m["engine_busy_s"] / m["collect_s"] for m in runs), 3),
            # blocked waiting for environments with nothing to generate
            "env_wait_share": round(statistics.median(
                m["env_s"] / m["collect_s"] for m in runs), 3),
            "collect_s": round(statistics.median(m["collect_s"] for m in runs), 3),
            "tool_calls_per_episode": round(statistics.median(
                m["tool_calls"] / m["episodes"] for m in runs), 3),
            "turns_per_episode": round(statistics.median(
                m["turns"] / m["episodes"] for m in runs), 3)}
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
