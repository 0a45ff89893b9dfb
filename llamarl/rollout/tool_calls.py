"""Tool calls as the model writes them, parsed from one assistant turn's text.

Two formats (rollout.tool_format):

    hermes    <tool_call>{"name": "calculate", "arguments": {"expression": "3*7"}}</tool_call>
              (Qwen2.5, Hermes and most chat models; several calls per turn allowed). The
              results go back as {"role": "tool"} messages through the model's chat template.
    compact   the whole turn is "*name arg", or "*arg" when the environment has one tool
              (small character-level models, the tiny lookup task). The result goes back as
              the environment's observation text.

A turn with no call is the episode's final answer. A call that cannot be parsed (bad JSON, no
name, an unknown tool, an unclosed tag) is not an error of the run: it becomes an observation
the model sees ("error: ..."), and is counted as `malformed`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    args: list = field(default_factory=list)  # positional arguments
    kwargs: dict = field(default_factory=dict)  # keyword arguments


@dataclass
class ParsedTurn:
    calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)  # why each bad call was rejected

    @property
    def is_answer(self) -> bool:
        return not self.calls and not self.malformed


def parse_turn(text: str, fmt: str, tools: dict) -> ParsedTurn:
    """The calls of one assistant turn (`tools`: the environment's name -> function)."""
    if fmt == "hermes":
        return _parse_hermes(text, tools)
    if fmt == "compact":
        return _parse_compact(text, tools)
    raise ValueError(f"rollout.tool_format {fmt!r}: use hermes or compact")


def _parse_hermes(text: str, tools: dict) -> ParsedTurn:
    out = ParsedTurn()
    for body, close in _HERMES.findall(text):
        if not close:
            out.malformed.append("<tool_call> is not closed by </tool_call>")
            continue
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as e:
            out.malformed.append(f"the tool call is not valid JSON ({e.msg})")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            out.malformed.append('a tool call needs {"name": ..., "arguments": {...}}')
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            out.malformed.append(f"the arguments of {obj['name']!r} are not an object")
            continue
        if obj["name"] not in tools:
            out.malformed.append(f"there is no tool {obj['name']!r} (tools: "
                                 f"{', '.join(sorted(tools))})")
            continue
        out.calls.append(ToolCall(obj["name"], kwargs=args))
    return out


def _parse_compact(text: str, tools: dict) -> ParsedTurn:
    out = ParsedTurn()
    body = text.strip()
    if not body.startswith("*"):
        return out
    body = body[1:].strip()
    name, _, arg = body.partition(" ")
    if name in tools and arg:
        out.calls.append(ToolCall(name, args=[arg]))
    elif len(tools) == 1 and body:
        out.calls.append(ToolCall(next(iter(tools)), args=[body]))
    else:
        out.malformed.append(f"cannot read the tool call {body!r}")
    return out
