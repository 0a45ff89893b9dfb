"""What streaming costs (issue 66: at most 1.05x the non-streamed step on the same agent
task): the tiny lookup task's agent episodes (llamarl/envs/lookup_agent.py) collected
through the gateway with `stream=False` and with `stream=True` (the same agent, reading the
server-sent events as the openai SDK assembles them), on the same engine, prompts and
sampler seeds, collections alternating between the two so load drifts hit both alike.

Per mode: the median collection time over --repeats (after a warm-up each), the turns per
episode (the same agent, so the same work), and the ratio streamed / non-streamed.

    python bench/agent_streaming.py [--prompts 32] [--samples 8] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import openai

from llamarl.envs.lookup_agent import MAX_TURNS, lookup
from llamarl.tiny.lookup import CALL, SEPARATOR, lookup_reward


def streamed_lookup_agent(client: openai.OpenAI, row: dict) -> dict:
    """lookup_agent (llamarl/envs/lookup_agent.py) with stream=True: each call's text and
    finish reason assembled from the stream's chunks."""
    text, turn, calls = row["prompt"], "", 0
    for _ in range(MAX_TURNS):
        try:
            stream = client.completions.create(model="policy", prompt=text, stream=True)
        except openai.BadRequestError:
            break
        turn, finish = "", None
        for chunk in stream:
            for c in chunk.choices:
                turn += c.text
                finish = c.finish_reason or finish
        if finish != "stop" or not turn.strip().startswith(CALL):
            break
        calls += 1
        text += turn + lookup(row["table"], turn.strip()[1:]) + SEPARATOR
    return {"reward": lookup_reward(turn, row["answer"]), "metrics": {"tool_calls": calls}}


def main() -> None:
    import torch

    from llamarl.config import load_config
    from llamarl.data.prompts import PromptFormatter
    from llamarl.generator.engine import Engine
    from llamarl.models.tiny import warm_start_dir
    from llamarl.rollout.source import SourceContext, build_source
    from llamarl.tiny import lookup as lookup_task
    from llamarl.trainer.warmstart import run_warm_start

    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench/results/agent_streaming.json")
    args = ap.parse_args()
    path = warm_start_dir("lookup")
    if not (path / "config.json").is_file():
        run_warm_start("lookup", path, None, torch.device("cpu"))
    modes = {"non_streamed": "rollout.agent=lookup",
             "streamed": "rollout.agent=agent_streaming:streamed_lookup_agent"}
    engine, sources, times = None, {}, {m: [] for m in modes}
    turns = {m: [] for m in modes}
    try:
        for name, agent in modes.items():
            cfg = load_config("recipes/tiny_tool_cpu.yaml", [
                "rollout.source=agent", agent, "rollout.threads_per_worker=128"])
            if engine is None:
                engine = Engine(str(path), cfg.generator, "float32", 0, True,
                                sequences=args.prompts * args.samples)
            fmt = PromptFormatter(engine.tokenizer)
            sources[name] = build_source(SourceContext(cfg, engine, engine.tokenizer, fmt,
                                                       None, 0))
        prompts = fmt.encode(lookup_task.sample_examples(args.prompts, "train", 0))
        for r in range(args.repeats + 1):  # alternating; the first of each is a warm-up
            for name, source in sources.items():
                m = source.collect(prompts, args.samples, 1.0, 1000 + r, 0, step=r).metrics
                if r:
                    times[name].append(m["collect_s"])
                    turns[name].append(m["turns"] / m["episodes"])
    finally:
        for source in sources.values():
            source.close()
    result = {"model": "lookup warm start", "episodes_per_collection":
              args.prompts * args.samples, "repeats": args.repeats,
              **{name: {"collect_s_median": round(statistics.median(times[name]), 3),
                        "collect_s": [round(t, 3) for t in times[name]],
                        "turns_per_episode_median": round(statistics.median(turns[name]), 3)}
                 for name in modes},
              "load_average_1m": round(os.getloadavg()[0], 2)}
    result["ratio_streamed_over_non_streamed"] = round(
        result["streamed"]["collect_s_median"] / result["non_streamed"]["collect_s_median"], 3)
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
