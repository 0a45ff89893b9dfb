"""The multi-turn environment API: what a user writes to train an agent.

One `Environment` instance is one episode. llamarl builds it from the dataset row, asks for the
first prompt, and after every assistant turn parses the turn's tool calls
(llamarl/rollout/tool_calls.py), runs them against `tools()`, and gives the results to
`observation()`; a turn without a call is the final answer, scored by `reward()`:

    env = Env(row)
    context = prompt()                      str (the raw prompt) or chat messages
    repeat:  model samples a turn
             no tool call -> reward(turn text); the episode ends ("stop")
             else results = [tool(args) as text, or "error: ..."] -> observation(results)
                  is appended to the context (str: its tokens; messages: rendered through
                  the chat template) and the model samples the next turn
    limits (rollout.max_turns, rollout.max_tokens, generator.max_new_tokens per turn) end
    an episode early; reward(last turn text) still scores it.

Environment code runs in worker processes (llamarl/rollout/env_worker.py): a tool that hangs
or crashes is timed out or contained, never the run. Override `turn()` to handle a turn
yourself (anything other than tool calls).
"""

from __future__ import annotations

from collections.abc import Callable

from llamarl.rollout.tool_calls import parse_turn


class Environment:
    def __init__(self, row: dict):
        # the dataset row: every field, with "prompt" and "answer" set to the ones
        # data.prompt_field and data.answer_field name
        self.row = row

    def prompt(self) -> str | list[dict]:
        """The first context: the prompt text (formatted like single-turn prompts: the chat
        template when data.chat_template is true) or a list of chat messages."""
        return self.row["prompt"]

    def tools(self) -> dict[str, Callable[..., object]]:
        """name -> plain Python function; its return value is shown to the model as text."""
        return {}

    def observation(self, results: list[str]) -> str | list[dict]:
        """What the model sees after its tool calls: raw text (appended as tokens), or
        messages rendered through the chat template (default: one "tool" message each)."""
        return [{"role": "tool", "content": r} for r in results]

    def reward(self, answer: str) -> float:
        """The episode's reward, from the final turn's text."""
        raise NotImplementedError

    # -- what llamarl calls ----------------------------------------------------------------
    def turn(self, text: str, tool_format: str) -> tuple[str | list[dict] | None, dict]:
        """One assistant turn -> (observation, or None when `text` is the final answer;
        counts {tool_calls, tool_errors, malformed})."""
        tools = self.tools()
        parsed = parse_turn(text, tool_format, tools)
        counts = {"tool_calls": len(parsed.calls), "tool_errors": 0,
                  "malformed": len(parsed.malformed)}
        if parsed.is_answer:
            return None, counts
        results = []
        for call in parsed.calls:
            try:
                results.append(str(tools[call.name](*call.args, **call.kwargs)))
            except Exception as e:  # a tool's failure is the model's observation
                counts["tool_errors"] += 1
                results.append(f"error: {call.name} raised {type(e).__name__}: {e}")
        results += [f"error: {m}" for m in parsed.malformed]
        return self.observation(results), counts
