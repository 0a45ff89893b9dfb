"""The tiny tool task (llamarl/tiny/lookup.py) written as an OpenAI-client agent.

The same episodes as rollout.env = lookup (llamarl/envs/lookup.py) under rollout.source =
multi_turn, but driven by the agent through the gateway's /v1/completions, as an agent for
a base model would be: the prompt text, then after each turn that calls the tool
("*key") the turn's text, the tool's result and "=". The gateway splices each call onto
the previous call's sampled ids (rollout/capture.py), so the trained sequence is the one
the multi-turn source builds: [<bos> ab= | *a<eos> | 3= | *b<eos> | 7= | 37<eos>].

    rollout.source: agent
    rollout.agent: lookup          # this function
"""

from __future__ import annotations

import openai

from llamarl.tiny.lookup import CALL, KEYS, SEPARATOR, lookup_reward

MAX_TURNS = 4  # as recipes/tiny_tool_cpu.yaml's rollout.max_turns


def lookup(table: str, key: str) -> str:
    """The tool: the digit under `key`, or "-" (an unknown key, a malformed call)."""
    key = key.strip()
    return table[KEYS.index(key)] if len(key) == 1 and key in KEYS else "-"


def lookup_agent(client: openai.OpenAI, row: dict) -> dict:
    text, turn = row["prompt"], ""
    calls = 0
    for _ in range(MAX_TURNS):
        try:
            out = client.completions.create(model="policy", prompt=text)
        except openai.BadRequestError:  # the context is full: score the last turn
            break
        choice = out.choices[0]
        turn = choice.text
        if choice.finish_reason != "stop" or not turn.strip().startswith(CALL):
            break  # the final answer (or a turn cut at its token limit)
        calls += 1
        text += turn + lookup(row["table"], turn.strip()[1:]) + SEPARATOR
    return {"reward": lookup_reward(turn, row["answer"]), "metrics": {"tool_calls": calls}}
