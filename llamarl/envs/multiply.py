"""Products with a calculator tool, for a small chat model (SmolLM2-135M-Instruct).

"What is 237 * 82?": a 3-digit by 2-digit product, which a 135M model cannot work out but
can read off a tool (the base model's sampled episodes get 2-5% of the held-out ones right,
its greedy ones 68%, calling the tool). The model calls `calculate(expression)` in the Hermes
format, sees the result as a "tool" message through its own chat template, and ends with the
number; the reward is the built-in numeric verifier (the last number) on that final turn.

SmolLM2's template has no tool section, so the tool is described in the system prompt, and
one worked example conversation (question, call, result, answer) precedes the question: with
it, about half of the base model's sampled first turns begin a tool call (27 of 48 tried);
with the example written out in the system prompt instead, none did (0 of 24).

    rollout.source: multi_turn         rollout.source: agent
    rollout.env: multiply              rollout.agent: multiply (envs/multiply_agent.py)
"""

from __future__ import annotations

import json

from llamarl.envs.calculator import calculate
from llamarl.rewards.verifiers import numeric
from llamarl.rollout.environment import Environment

TOOL = {"type": "function", "function": {
    "name": "calculate",
    "description": "Evaluate an arithmetic expression (+ - * / and parentheses).",
    "parameters": {"type": "object", "required": ["expression"],
                   "properties": {"expression": {"type": "string",
                                                 "description": "for example 214 * 37"}}}}}

SYSTEM = ("You are a helpful assistant with a calculator tool. Always call the calculator "
          "for arithmetic by writing <tool_call>{\"name\": \"calculate\", \"arguments\": "
          "{\"expression\": \"...\"}}</tool_call>, then answer with just the number.")

_EXAMPLE_CALL = {"name": "calculate", "arguments": {"expression": "214 * 37"}}


def example() -> list[dict]:
    """The worked example: question, the call (as the text the model writes: SmolLM2's
    template renders an assistant message's content only), the tool's result, the answer."""
    return [{"role": "user", "content": "What is 214 * 37?"},
            {"role": "assistant",
             "content": f"<tool_call>{json.dumps(_EXAMPLE_CALL)}</tool_call>"},
            {"role": "tool", "content": "7918"}, {"role": "assistant", "content": "7918"}]


def messages(question: str) -> list[dict]:
    """The first context: the system prompt, the worked example, the question."""
    return [{"role": "system", "content": SYSTEM}] + example() + [
        {"role": "user", "content": question}]


class MultiplyEnv(Environment):
    def prompt(self) -> list[dict]:
        return messages(self.row["prompt"])

    def tools(self):
        return {"calculate": calculate}

    def reward(self, answer: str) -> float:
        return numeric(answer, str(self.row["answer"]), self.row["prompt"])
