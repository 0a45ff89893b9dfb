"""What streaming costs (issue 66: at most 1.05x the non-streamed step on the same agent
task): the tiny lookup task's agent episodes (llamarl/envs/lookup_agent.py) collected
through the gateway with `stream=False` and with `stream=True` (the same agent, reading the
server-sent events as the openai SDK assembles them), on the same engine, prompts and
sampler seeds, collections alternating between the two (and which goes first) so load
drifts and order effects hit both alike.

Per mode: the median collection time over --repeats (after a warm-up each), the turns per
episode (the same agent, so the same work), the engine's busy share and steps per collection,
and the ratio streamed / non-streamed; and one call's HTTP round trip, plain and streamed,
with no engine (what the events cost by themselves).

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


def http_round_trip(calls: int = 300) -> dict:
    """Median round trip of one /v1/completions call, plain and streamed, through uvicorn,
    FastAPI and the gateway's queue, answered at once by a thread (no engine): what the
    server-sent events cost a call by themselves."""
    import time

    from agent_gateway import echo_gateway

    client, stop = echo_gateway()
    lat: dict[str, list[float]] = {"plain": [], "streamed": []}
    for i in range(2 * calls):  # alternating
        mode = "streamed" if i % 2 else "plain"
        t0 = time.perf_counter()
        if mode == "streamed":
            for _chunk in client.completions.create(model="policy", prompt="ab=", stream=True):
                pass
        else:
            client.completions.create(model="policy", prompt="ab=")
        lat[mode].append(time.perf_counter() - t0)
    stop()
    return {f"{m}_ms_median": round(1000 * statistics.median(v), 2) for m, v in lat.items()}


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
    busy = {m: [] for m in modes}  # the engine stepped for this share of the collection
    steps = {m: [] for m in modes}  # engine steps per collection
    stepped = [0]
    try:
        for name, agent in modes.items():
            cfg = load_config("recipes/tiny_tool_cpu.yaml", [
                "rollout.source=agent", agent, "rollout.threads_per_worker=128"])
            if engine is None:
                engine = Engine(str(path), cfg.generator, "float32", 0, True,
                                sequences=args.prompts * args.samples)
                def counted_step(step=engine.step):  # engine steps (the calls' batching)
                    out = step()
                    stepped[0] += 1
                    return out

                engine.step = counted_step
            fmt = PromptFormatter(engine.tokenizer)
            sources[name] = build_source(SourceContext(cfg, engine, engine.tokenizer, fmt,
                                                       None, 0))
        prompts = fmt.encode(lookup_task.sample_examples(args.prompts, "train", 0))
        for r in range(args.repeats + 1):  # alternating, which goes first too; the first
            # of each is a warm-up
            for name, source in sorted(sources.items(), reverse=bool(r % 2)):
                stepped[0] = 0
                m = source.collect(prompts, args.samples, 1.0, 1000 + r, 0, step=r).metrics
                if r:
                    times[name].append(m["collect_s"])
                    turns[name].append(m["turns"] / m["episodes"])
                    busy[name].append(m["engine_busy_s"] / m["collect_s"])
                    steps[name].append(stepped[0])
    finally:
        for source in sources.values():
            source.close()
    result = {"model": "lookup warm start", "episodes_per_collection":
              args.prompts * args.samples, "repeats": args.repeats,
              **{name: {"collect_s_median": round(statistics.median(times[name]), 3),
                        "collect_s": [round(t, 3) for t in times[name]],
                        "turns_per_episode_median": round(statistics.median(turns[name]), 3),
                        "engine_busy_share_median": round(statistics.median(busy[name]), 3),
                        "engine_steps_median": statistics.median(steps[name])}
                 for name in modes},
              "load_average_1m": round(os.getloadavg()[0], 2)}
    result["http_round_trip"] = http_round_trip()
    result["ratio_streamed_over_non_streamed"] = round(
        result["streamed"]["collect_s_median"] / result["non_streamed"]["collect_s_median"], 3)
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
