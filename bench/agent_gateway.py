"""What the gateway costs: the tiny lookup task's episodes collected by the in-process
multi-turn source (rollout.env = lookup) and by the OpenAI-client agent through the engine's
gateway (rollout.agent = lookup, llamarl/envs/lookup_agent.py), on the same engine, prompts
and sampler seeds; and the HTTP layer alone (a gateway answered at once by a thread, driven
by one `openai` client: the per-call cost with no engine and no contention).

Per collection (medians over --repeats after a warm-up): the step's collection time, turns
(model calls) per episode, and per model call the engine's own latency (submit to finish,
read off Engine.submit/step) against, for the agent, the latency its client sees (HTTP, the
gateway's queue, rendering, the engine, the response), and the CPU seconds per call of
the generator process and of the environment / agent worker processes.

    python bench/agent_gateway.py     (builds the tiny lookup warm start if needed)

Workload smollm2 (--workload smollm2): whole training runs on the real model, where the
gateway's step goal is judged: recipes/smollm2_tool_cpu.yaml (the multiply task through the
in-process multi-turn source) and recipes/smollm2_agent_cpu.yaml (the same task as an
OpenAI-client agent through the gateway), one after the other for each of --seeds, with the
same prompts and settings. Per run: the median step and its split (wait for the engine,
update), over the steps that no evaluation precedes (an evaluation runs on the engine
between steps and would be counted in the next step's wait), the turns and tool calls per
episode, the held-out reward at each evaluation, and the gateway's prefix breaks.

    python bench/agent_gateway.py --workload smollm2 [--seeds 0 1] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from llamarl.envs.lookup_agent import lookup_agent


def timed_lookup_agent(client, row):
    """lookup_agent, with the wall time of each of its model calls as metrics."""
    create, spent = client.completions.create, []

    def timed(**kw):
        t0 = time.perf_counter()
        try:
            return create(**kw)
        finally:
            spent.append(time.perf_counter() - t0)

    client.completions.create = timed
    out = lookup_agent(client, row)
    out["metrics"].update(call_ms=1000 * sum(spent), calls=len(spent))
    return out


def echo_gateway():
    """A started gateway whose completion calls a thread answers at once ("ok"), an openai
    client on it, and a stop() that ends both: the HTTP layer alone, with no engine."""
    import threading

    import httpx
    import openai

    from llamarl.gateway.server import Gateway, resolve

    g = Gateway("policy", 1.0)
    g.start()
    key, done = g.open_episode(0), threading.Event()
    body = {"id": "x", "object": "text_completion", "created": 0, "model": "policy",
            "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    def answer():
        while not done.is_set():
            try:
                resolve(g.calls.get(timeout=0.05), 200, body)
            except Exception:  # noqa: BLE001 - queue.Empty
                pass

    threading.Thread(target=answer, daemon=True).start()
    client = openai.OpenAI(base_url=g.base_url, api_key=key, max_retries=0,
                           http_client=httpx.Client(trust_env=False, verify=False))

    def stop():
        done.set()
        g.close()

    return client, stop


def http_only(calls: int = 300) -> dict:
    """Median round trip of /v1/completions through uvicorn, FastAPI and the gateway's queue,
    answered by a thread at once; the openai client's and the server thread's CPU per call."""
    import threading

    import psutil

    client, stop = echo_gateway()
    server = next(t for t in threading.enumerate() if t.name == "llamarl-gateway").native_id
    me = psutil.Process()

    def server_cpu():
        return next(t.user_time + t.system_time for t in me.threads() if t.id == server)

    lat, cpu0, s0 = [], time.thread_time(), server_cpu()
    for _ in range(calls):
        t0 = time.perf_counter()
        client.completions.create(model="policy", prompt="ab=")
        lat.append(time.perf_counter() - t0)
    out = {"median_ms_per_call": round(1000 * statistics.median(lat), 2),
           "client_cpu_ms_per_call": round(1000 * (time.thread_time() - cpu0) / calls, 2),
           "server_cpu_ms_per_call": round(1000 * (server_cpu() - s0) / calls, 2)}
    stop()
    return out


def _cpu(source) -> tuple[float, float]:
    """CPU seconds so far of this process and of the source's worker processes."""
    import psutil

    me = psutil.Process().cpu_times()
    workers = [psutil.Process(p.pid).cpu_times() for p in source.pool._procs]
    return me.user + me.system, sum(w.user + w.system for w in workers)


def sleepy_lookup_agent(client, row):
    """lookup_agent whose tool takes 0-50 ms (a remote call): the model call is made, then the
    agent sleeps before the next, as bench/multi_turn_concurrency.py's SlowLookupEnv."""
    import random

    create = client.completions.create

    def slow(**kw):
        out = create(**kw)
        if out.choices[0].text.strip().startswith("*"):
            time.sleep(random.uniform(0.0, 0.05))
        return out

    client.completions.create = slow
    return lookup_agent(client, row)


def concurrency_and_leaks(engine, fmt, steps: int) -> dict:
    """64 agent episodes per collection (8 prompts x 8) whose tools sleep 0-50 ms, `steps`
    collections: the engine's busy share, and the open file descriptors and TCP connections
    of the generator and agent processes after each (no growth is the check)."""
    import psutil

    from llamarl.config import load_config
    from llamarl.rollout.source import SourceContext, build_source
    from llamarl.tiny import lookup

    cfg = load_config("recipes/tiny_tool_cpu.yaml", [
        "rollout.source=agent", "rollout.agent=agent_gateway:sleepy_lookup_agent",
        "rollout.threads_per_worker=32"])
    source = build_source(SourceContext(cfg, engine, engine.tokenizer, fmt, None, 0))
    prompts = fmt.encode(lookup.sample_examples(8, "train", 1))
    busy, fds, conns = [], [], []
    try:
        for r in range(steps):
            m = source.collect(prompts, 8, 1.0, 5000 + r, 0, step=r).metrics
            busy.append(m["engine_busy_s"] / m["collect_s"])
            procs = [psutil.Process()] + [psutil.Process(p.pid) for p in source.pool._procs]
            fds.append(sum(p.num_fds() for p in procs))
            conns.append(sum(len(p.net_connections(kind="tcp")) for p in procs))
    finally:
        source.close()
    return {"collections": steps, "episodes_per_collection": 64,
            "engine_busy_share_median": round(statistics.median(busy), 3),
            "fds_first_peak_last": [fds[0], max(fds), fds[-1]],
            "tcp_connections_first_peak_last": [conns[0], max(conns), conns[-1]],
            # after collections 1, 2, 5, 10, 20, 50, 100, 200 (those run)
            "fds_at": {n: fds[n - 1] for n in (1, 2, 5, 10, 20, 50, 100, 200) if n <= steps},
            "tcp_connections_at": {n: conns[n - 1] for n in (1, 2, 5, 10, 20, 50, 100, 200)
                                   if n <= steps}}


def _note_latency(engine) -> list[float]:
    """Record each request's submit-to-finish seconds into the returned list."""
    started, out = {}, []
    submit, step = engine.submit, engine.step

    def noting_submit(rid, *a, **kw):
        started[rid] = time.perf_counter()
        return submit(rid, *a, **kw)

    def noting_step():
        done = step()
        now = time.perf_counter()
        out.extend(now - started.pop(rid) for rid, _ in done if rid in started)
        return done

    engine.submit, engine.step = noting_submit, noting_step
    return out


def _steady(metrics: list[dict], key: str, eval_every: int) -> float:
    """Median of `key` over the steps no evaluation precedes (steps 1, e+1, 2e+1, ... wait
    for one: the evaluation before them runs on the engine)."""
    return statistics.median(m[key] for m in metrics if (m["step"] - 1) % eval_every)


def smollm2_side_by_side(seeds: list[int], steps: int, out: str) -> dict:
    """The two SmolLM2 recipes, trained one after the other per seed (module docstring)."""
    import os

    from launch_logs import launch_recipe, torchrun_logs_in_temp

    from llamarl.config import load_config

    torchrun_logs_in_temp()
    recipes = {"in_process_multi_turn": "recipes/smollm2_tool_cpu.yaml",
               "gateway_agent": "recipes/smollm2_agent_cpu.yaml"}
    result = {"workload": "smollm2", "recipes": recipes, "steps": steps, "runs": []}
    for seed in seeds:
        for name, recipe in recipes.items():
            run_dir, metrics, evals = launch_recipe(
                recipe, [f"run.seed={seed}", f"run.steps={steps}"],
                f"llamarl-gateway-{name}-s{seed}-")
            every = load_config(recipe).run.eval_every
            row = {"source": name, "seed": seed,
                   "step_s_median": round(_steady(metrics, "step_time_s", every), 2),
                   "wait_s_median": round(_steady(metrics, "wait_s", every), 2),
                   "train_s_median": round(_steady(metrics, "train_s", every), 2),
                   "turns_per_episode": round(statistics.median(
                       m["turns_per_episode"] for m in metrics), 3),
                   # the agent runs its tools itself and reports them as a metric
                   "tool_calls_per_episode_last": metrics[-1].get(
                       "agent_tool_calls", metrics[-1]["tool_calls_per_episode"]),
                   "held_out": {e["step"]: round(e["reward_mean"], 4) for e in evals},
                   "held_out_greedy": {e["step"]: round(e["reward_mean_greedy"], 4)
                                       for e in evals if "reward_mean_greedy" in e},
                   "total_s": round(metrics[-1]["elapsed_s"], 1)}
            if name == "gateway_agent":
                row["prefix_breaks"] = sum(m.get("prefix_breaks", 0) for m in metrics)
                row["agent_errors"] = sum(m.get("agent_errors", 0) + m.get("agent_timeouts", 0)
                                          for m in metrics)
            result["runs"].append(row)
            print(json.dumps(row), flush=True)
            Path(out + ".partial.json").write_text(json.dumps(result, indent=1) + "\n")
    ratios = []
    for seed in seeds:
        a, b = (next(r for r in result["runs"] if r["seed"] == seed and r["source"] == n)
                for n in ("gateway_agent", "in_process_multi_turn"))
        ratios.append(a["step_s_median"] / b["step_s_median"])
    result["step_ratio_per_seed"] = [round(r, 3) for r in ratios]
    result["step_ratio_median"] = round(statistics.median(ratios), 3)
    result["load_average_1m"] = os.getloadavg()[0]  # the machine may be shared
    return result


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
    ap.add_argument("--leak-steps", type=int, default=200,
                    help="collections of 64 sleepy-tool episodes for the fd/connection check")
    ap.add_argument("--out", help="default: bench/results/agent_gateway.json (tiny), "
                    "agent_gateway_smollm2.json (smollm2)")
    ap.add_argument("--workload", choices=("tiny", "smollm2"), default="tiny")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="smollm2 only")
    ap.add_argument("--steps", type=int, default=10, help="smollm2 only: steps per run")
    args = ap.parse_args()
    if args.workload == "smollm2":
        out = args.out or "bench/results/agent_gateway_smollm2.json"
        result = smollm2_side_by_side(args.seeds, args.steps, out)
        print(json.dumps(result, indent=1))
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
        return
    args.out = args.out or "bench/results/agent_gateway.json"
    path = warm_start_dir("lookup")
    if not (path / "config.json").is_file():
        run_warm_start("lookup", path, None, torch.device("cpu"))
    result = {"model": "lookup warm start", "repeats": args.repeats,
              "episodes_per_collection": args.prompts * args.samples}
    engine, latencies = None, []
    for name, overrides in (
            ("in_process_multi_turn", ["rollout.source=multi_turn", "rollout.env=lookup"]),
            ("gateway_agent", ["rollout.source=agent",
                               "rollout.agent=agent_gateway:timed_lookup_agent",
                               "rollout.threads_per_worker=128"])):
        cfg = load_config("recipes/tiny_tool_cpu.yaml", overrides)
        if engine is None:
            engine = Engine(str(path), cfg.generator, "float32", 0, True,
                            sequences=args.prompts * args.samples)
            latencies = _note_latency(engine)
        fmt = PromptFormatter(engine.tokenizer)
        source = build_source(SourceContext(cfg, engine, engine.tokenizer, fmt, None, 0))
        prompts = fmt.encode(lookup.sample_examples(args.prompts, "train", 0))
        runs = []
        try:
            for r in range(args.repeats + 1):
                latencies.clear()
                cpu0 = _cpu(source)
                got = source.collect(prompts, args.samples, 1.0, 1000 + r, 0, step=r)
                cpu1 = _cpu(source)
                got.metrics["cpu_generator"] = cpu1[0] - cpu0[0]
                got.metrics["cpu_workers"] = cpu1[1] - cpu0[1]
                if r:  # the first is a warm-up
                    runs.append((got.metrics, statistics.median(latencies)))
        finally:
            source.close()
        m0 = [m for m, _ in runs]
        row = {"collect_s": round(statistics.median(m["collect_s"] for m in m0), 3),
               "turns_per_episode": round(statistics.median(
                   m["turns"] / m["episodes"] for m in m0), 3),
               "engine_busy_share": round(statistics.median(
                   m["engine_busy_s"] / m["collect_s"] for m in m0), 3),
               "engine_ms_per_call_median": round(1000 * statistics.median(
                   lat for _, lat in runs), 2),
               "generator_cpu_ms_per_call": round(1000 * statistics.median(
                   m["cpu_generator"] / m["turns"] for m in m0), 2),
               "worker_cpu_ms_per_call": round(1000 * statistics.median(
                   m["cpu_workers"] / m["turns"] for m in m0), 2)}
        if "agent_calls" in m0[0]:
            row["client_ms_per_call_mean"] = round(statistics.median(
                m["agent_call_ms"] / m["agent_calls"] for m in m0), 2)
            row["prefix_breaks"] = sum(m["prefix_breaks"] for m in m0)
            row["agent_errors"] = sum(m["agent_errors"] + m["agent_timeouts"] for m in m0)
        result[name] = row
    result["http_only"] = http_only()
    if args.leak_steps:
        result["sleepy_tools_64_episodes"] = concurrency_and_leaks(
            engine, PromptFormatter(engine.tokenizer), args.leak_steps)
    result["load_average_1m"] = __import__("os").getloadavg()[0]  # the machine is shared
    a, b = result["gateway_agent"], result["in_process_multi_turn"]
    result["step_ratio"] = round(a["collect_s"] / b["collect_s"], 3)
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
