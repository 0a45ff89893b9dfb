"""The multiply task (llamarl/envs/multiply.py) written as an OpenAI-client agent.

The same episodes as rollout.env = multiply under rollout.source = multi_turn, driven through
the gateway's /v1/chat/completions with `tools`, as an agent written for any OpenAI-style
server would be: the gateway's Hermes parser (rollout.tool_parser) turns the model's
<tool_call> into the message's `tool_calls`; the agent runs them and sends the results back
as "tool" messages, the reply appended unchanged, so the gateway splices each call onto the
previous one's sampled tokens (rollout/capture.py) and the episode trains on one sequence.

    rollout.source: agent
    rollout.agent: multiply        # this function
"""

from __future__ import annotations

import json

import openai

from llamarl.envs.calculator import calculate
from llamarl.envs.multiply import TOOL, messages
from llamarl.rewards.verifiers import numeric

MAX_TURNS = 3  # as recipes/smollm2_tool_cpu.yaml's rollout.max_turns


def run_call(call) -> str:
    """One tool call's result as the model sees it ("error: ..." for a bad one, as the
    multi-turn source's environments report it)."""
    try:
        if call.function.name != "calculate":
            return f"error: there is no tool {call.function.name!r} (tools: calculate)"
        return calculate(json.loads(call.function.arguments)["expression"])
    except Exception as e:  # noqa: BLE001 - the model's mistake is its observation
        return f"error: calculate raised {type(e).__name__}: {e}"


def multiply_agent(client: openai.OpenAI, row: dict) -> dict:
    history, answer, calls = messages(row["prompt"]), "", 0
    for _ in range(MAX_TURNS):
        try:
            out = client.chat.completions.create(model="policy", messages=history,
                                                 tools=[TOOL])
        except openai.BadRequestError:  # the context is full: score the last turn
            break
        reply = out.choices[0].message
        answer = reply.content or ""
        if not reply.tool_calls:
            break  # the final answer
        history.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls:
            calls += 1
            history.append({"role": "tool", "tool_call_id": call.id, "content": run_call(call)})
    return {"reward": numeric(answer, str(row["answer"]), row["prompt"]),
            "metrics": {"tool_calls": calls}}
