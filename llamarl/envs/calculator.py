"""GSM8K with a calculator tool, for chat models that write Hermes-style tool calls (Qwen2.5
and most instruct models; rollout.tool_format = hermes).

The system prompt describes the tool in the model's own terms; the model may call
`calculate(expression)` any number of times, then ends with "#### <number>". The reward is the
gsm8k verifier on the final turn (llamarl/rewards/verifiers.py).
"""

from __future__ import annotations

import ast
import json
import operator

from llamarl.rewards.verifiers import gsm8k
from llamarl.rollout.environment import Environment

TOOL = {"type": "function", "function": {
    "name": "calculate",
    "description": "Evaluate an arithmetic expression (+ - * / ** % and parentheses).",
    "parameters": {"type": "object", "required": ["expression"],
                   "properties": {"expression": {"type": "string",
                                                 "description": "for example (12 + 7) * 3"}}}}}

SYSTEM = ("You are a careful math tutor. Use the calculate tool for arithmetic. Call it by "
          "writing <tool_call>{\"name\": \"calculate\", \"arguments\": {\"expression\": "
          "\"...\"}}</tool_call>. When you know the answer, end with a line '#### <number>'.\n"
          "Tool: " + json.dumps(TOOL))

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.Pow: operator.pow, ast.Mod: operator.mod,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """Arithmetic only (no names, calls or attributes): safe to run on model output."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    value = ev(ast.parse(str(expression), mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


class CalculatorEnv(Environment):
    def prompt(self) -> list[dict]:
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": self.row["prompt"]}]

    def tools(self):
        return {"calculate": calculate}

    def reward(self, answer: str) -> float:
        return gsm8k(answer, str(self.row["answer"]), self.row["prompt"])
