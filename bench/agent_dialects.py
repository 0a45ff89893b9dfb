"""The gateway's dialects learning the same task: recipes/smollm2_agent_cpu.yaml (SmolLM2's
calculator task, an agent through the gateway) with its agent written three ways, one run
each per seed, the same prompts and settings:

    chat        llamarl/envs/multiply_agent.py: the openai SDK's chat.completions with tools
    responses   the openai SDK's Responses API, continued by previous_response_id
    messages    the anthropic SDK's messages.stream, tool_use / tool_result blocks

The worked example of the chat agent's prompt (a call written as text, its result as a tool
message) is given in each dialect's own terms: a function_call item and its output, or a
tool_use block and its tool_result (so the model sees the call as the template's hermes text
with newlines, which the chat agent's example writes without). Per run: the held-out reward
at each evaluation (sampled and greedy), the median step, prefix breaks, agent errors, the
gateway's refusals.

    python bench/agent_dialects.py [--seeds 0] [--steps 10] [--dialects chat responses messages]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from llamarl.envs.calculator import calculate
from llamarl.envs.multiply import SYSTEM, TOOL
from llamarl.rewards.verifiers import numeric

MAX_TURNS = 3  # as the chat agent's
EXAMPLE_Q, EXAMPLE_EXPR, EXAMPLE_A = "What is 214 * 37?", "214 * 37", "7918"
PARAMETERS = TOOL["function"]["parameters"]


def _run(name: str, arguments: dict) -> str:
    try:
        if name != "calculate":
            return f"error: there is no tool {name!r} (tools: calculate)"
        return calculate(arguments["expression"])
    except Exception as e:  # noqa: BLE001 - the model's mistake is its observation
        return f"error: calculate raised {type(e).__name__}: {e}"


def multiply_responses(client, row: dict) -> dict:
    """The multiply task on the Responses API: the example as items, each turn continued
    by previous_response_id with the tool results."""
    import openai

    tools = [{"type": "function", "name": "calculate",
              "description": TOOL["function"]["description"], "parameters": PARAMETERS}]
    call = json.dumps({"expression": EXAMPLE_EXPR})
    items = [{"role": "user", "content": EXAMPLE_Q},
             {"type": "function_call", "call_id": "ex", "name": "calculate", "arguments": call},
             {"type": "function_call_output", "call_id": "ex", "output": EXAMPLE_A},
             {"role": "assistant", "content": EXAMPLE_A},
             {"role": "user", "content": row["prompt"]}]
    answer, calls, previous = "", 0, None
    for _ in range(MAX_TURNS):
        try:
            out = client.responses.create(model="policy", instructions=SYSTEM, input=items,
                                          tools=tools, previous_response_id=previous)
        except openai.BadRequestError:  # the context is full: score the last turn
            break
        answer = out.output_text
        fn = [o for o in out.output if o.type == "function_call"]
        if not fn:
            break
        previous, items = out.id, []
        for c in fn:
            calls += 1
            try:
                args = json.loads(c.arguments)
            except json.JSONDecodeError:
                args = {}
            items.append({"type": "function_call_output", "call_id": c.call_id,
                          "output": _run(c.name, args)})
    return {"reward": numeric(answer, str(row["answer"]), row["prompt"]),
            "metrics": {"tool_calls": calls}}


def multiply_messages(client, row: dict) -> dict:
    """The multiply task on the Anthropic Messages API through the anthropic SDK, streamed
    (messages.stream), the example as a tool_use block and its tool_result."""
    import anthropic

    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    sdk = anthropic.Anthropic(base_url=root, api_key=client.api_key, max_retries=0)
    tools = [{"name": "calculate", "description": TOOL["function"]["description"],
              "input_schema": PARAMETERS}]
    messages = [{"role": "user", "content": EXAMPLE_Q},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "ex",
                                                   "name": "calculate",
                                                   "input": {"expression": EXAMPLE_EXPR}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "ex",
                                              "content": EXAMPLE_A}]},
                {"role": "assistant", "content": EXAMPLE_A},
                {"role": "user", "content": row["prompt"]}]
    answer, calls = "", 0
    for _ in range(MAX_TURNS):
        try:
            with sdk.messages.stream(model="policy", max_tokens=40, system=SYSTEM,
                                     tools=tools, messages=messages) as stream:
                final = stream.get_final_message()
        except anthropic.BadRequestError:
            break
        answer = "".join(b.text for b in final.content if b.type == "text")
        uses = [b for b in final.content if b.type == "tool_use"]
        if not uses:
            break
        messages.append({"role": "assistant",
                         "content": [b.model_dump(exclude_none=True) for b in final.content]})
        results = []
        for b in uses:
            calls += 1
            results.append({"type": "tool_result", "tool_use_id": b.id,
                            "content": _run(b.name, b.input)})
        messages.append({"role": "user", "content": results})
    return {"reward": numeric(answer, str(row["answer"]), row["prompt"]),
            "metrics": {"tool_calls": calls}}


AGENTS = {"chat": "multiply", "responses": "agent_dialects:multiply_responses",
          "messages": "agent_dialects:multiply_messages"}


def main() -> None:
    from agent_gateway import _steady
    from launch_logs import launch_recipe, torchrun_logs_in_temp

    from llamarl.config import load_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dialects", nargs="+", default=list(AGENTS), choices=list(AGENTS))
    ap.add_argument("--out", default="bench/results/agent_dialects.json")
    args = ap.parse_args()
    torchrun_logs_in_temp()
    recipe = "recipes/smollm2_agent_cpu.yaml"
    every = load_config(recipe).run.eval_every
    os.environ["PYTHONPATH"] = os.pathsep.join(  # (the agent workers import this module)
        [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])
    result = {"recipe": recipe, "steps": args.steps, "agents": AGENTS, "runs": []}
    for seed in args.seeds:
        for dialect in args.dialects:
            _, metrics, evals = launch_recipe(
                recipe, [f"run.seed={seed}", f"run.steps={args.steps}",
                         f"rollout.agent={AGENTS[dialect]}"], f"llamarl-dialect-{dialect}-")
            row = {"dialect": dialect, "seed": seed,
                   "held_out": {e["step"]: round(e["reward_mean"], 4) for e in evals},
                   "held_out_greedy": {e["step"]: round(e["reward_mean_greedy"], 4)
                                       for e in evals if "reward_mean_greedy" in e},
                   "step_s_median": round(_steady(metrics, "step_time_s", every), 2),
                   "tool_calls_per_episode_last": metrics[-1].get("agent_tool_calls"),
                   "prefix_breaks": sum(m.get("prefix_breaks", 0) for m in metrics),
                   "agent_errors": sum(m.get("agent_errors", 0) + m.get("agent_timeouts", 0)
                                       for m in metrics),
                   "gateway_4xx": sum(m.get("gateway_4xx", 0) for m in metrics),
                   "total_s": round(metrics[-1]["elapsed_s"], 1)}
            result["runs"].append(row)
            print(json.dumps(row), flush=True)
            Path(args.out + ".partial.json").write_text(json.dumps(result, indent=1) + "\n")
    result["load_average_1m"] = os.getloadavg()[0]
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    Path(args.out + ".partial.json").unlink(missing_ok=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
