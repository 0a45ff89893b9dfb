"""Token-exact capture: an agent episode's calls as the tokens the engine saw and sampled.

Prompts (built on the generator's thread, in call order per episode):

  * chat: the messages through the tokenizer's own chat template (`tools` passed through).
    Re-rendering a history re-tokenises the assistant's earlier turns, which need not give
    the tokens the engine sampled (and templates may render a turn differently once it is
    history). So where the request's messages begin with an earlier call's messages plus
    the reply that call returned (same tools), the agent runner splices instead of
    rendering: that call's prompt ids + the ids the engine sampled for the reply + the
    template's continuation for the new messages ("glue", as the multi-turn runner renders
    observations: context.py). The assistant turn is then in the context exactly as
    sampled (a stop string the reply's text was cut at stays in, as the engine's own
    tokens).
  * completion: a prompt that begins with an earlier call's prompt + returned text is
    spliced the same way (its ids + the sampled ids, then the rest tokenised alone); a list
    of token ids is used as given; any other text is tokenised (a BOS first, where the
    tokenizer has one, as data/prompts.py does for raw prompts).

Training sequence (EpisodeCapture.sample): calls chain where a call's prompt ids begin with
an earlier call's prompt + sampled ids, token for token: they merge into one sequence
[prompt | sampled | new context | sampled | ...] with the loss mask on sampled tokens only.
The episode trains on one sequence: the chain that ends in its last call's first choice.
A call whose prompt extends no earlier call (the agent edited or dropped history, or a
template re-rendered it differently) starts a new chain: a prefix break, counted
(`prefix_breaks`); tokens sampled outside the trained chain are dropped, counted
(`dropped_sampled_tokens`). Why one sequence: advantages are normalised over a prompt's G
episodes (GRPO and kin), and an episode counting as several samples would weigh more than
its siblings. Sampled text is never re-encoded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from llamarl.buffer.record import Sample
from llamarl.rollout.context import ContextEncoder


@dataclass
class _Turn:
    """One choice of a recorded call: the ids the engine saw and sampled, and what a later
    request must start with to be spliced onto it."""

    prompt_ids: list[int]
    completion: object  # generator.engine.Completion
    chat_key: list | None = None  # chat: the request's messages + this reply, as keys
    tools_key: str = ""
    text: str | None = None  # completion: the prompt text + the returned text

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion.token_ids


def message_key(m: dict) -> tuple:
    """What makes two messages the same for splicing: role, text, tool calls (name and
    arguments, not the call ids the client echoes), tool_call_id, name."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"],
                                                     sort_keys=True))
                  for c in m.get("tool_calls") or ())
    return (m["role"], m.get("content") or "", calls, m.get("tool_call_id"), m.get("name"))


_PROBE_TOOL = "llamarl_probe_tool"


def tool_calls_text(calls: list[dict], tool_format: str) -> str:
    """Tool calls written as the model writes them (the inverse of rollout.tool_parser):
    hermes `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` per call; for other
    parsers the calls as one JSON list of {"name", "arguments"} (llama3_json's and mistral's
    body)."""
    objs = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in calls]
    if tool_format == "hermes":
        return "".join(f"<tool_call>\n{json.dumps(o)}\n</tool_call>" for o in objs)
    return json.dumps(objs)


class Renderer:
    """Messages and text to prompt ids with `tokenizer` (the engine's).

    Messages are rendered as the model saw them (`as_seen`): a null or missing content is
    the empty string (templates that concatenate content fail on None: SmolLM2's); and where
    the template does not render an assistant message's `tool_calls` (SmolLM2's has no tool
    support; Qwen's does), the calls are written into its content, as the model sampled them:
    that turn's sampled text where the episode recorded it (`sampled`), else in the format of
    `tool_format` (rollout.tool_parser)."""

    def __init__(self, tokenizer, tool_format: str = "hermes"):
        self.tokenizer = tokenizer
        self.tool_format = tool_format
        self.glue = ContextEncoder(tokenizer, None).glue_text
        self.eos = tokenizer.eos_token_id
        self.renders_tool_calls = self._renders_tool_calls()

    def _renders_tool_calls(self) -> bool:
        """Whether the chat template writes an assistant message's tool_calls (a probe call's
        name appears in the rendering)."""
        probe = [{"role": "user", "content": "u"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": "c0", "type": "function",
                      "function": {"name": _PROBE_TOOL, "arguments": {}}}]}]
        try:
            text = self.tokenizer.apply_chat_template(probe, tokenize=False)
        except Exception:  # noqa: BLE001 - a template that refuses tool calls renders none
            return False
        return _PROBE_TOOL in text

    def as_seen(self, messages: list[dict], sampled: dict | None = None) -> list[dict]:
        """`messages` ready for the template (new dicts; the request's are not changed).
        `sampled`: message_key -> the text the engine sampled for that reply."""
        out = []
        for m in messages:
            m = dict(m)
            calls = m.get("tool_calls")
            if m.get("content") is None:
                m["content"] = ""
            if m["role"] == "assistant" and calls and not self.renders_tool_calls:
                text = (sampled or {}).get(message_key(m))
                m["content"] = text if text is not None else \
                    m["content"] + tool_calls_text(calls, self.tool_format)
                del m["tool_calls"]
            out.append(m)
        return out

    def chat(self, messages: list[dict], tools: list[dict] | None,
             sampled: dict | None = None) -> list[int]:
        text = self.tokenizer.apply_chat_template(self.as_seen(messages, sampled), tools=tools,
                                                  tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def text(self, text: str, first: bool) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        bos = self.tokenizer.bos_token_id
        return ([bos] if first and bos is not None else []) + ids

    def continuation(self, messages: list[dict], after: _Turn) -> list[int]:
        ended_eos = bool(after.completion.token_ids) and \
            after.completion.token_ids[-1] == self.eos
        return self.tokenizer(self.glue(self.as_seen(messages), ended_eos),
                              add_special_tokens=False)["input_ids"]


class EpisodeCapture:
    """The calls of one episode, in order."""

    def __init__(self, renderer: Renderer):
        self.r = renderer
        self.turns: list[list[_Turn]] = []  # per call, one per choice
        self.spliced = 0  # calls whose prompt reused an earlier call's sampled ids
        self.prefix_breaks = 0

    # -- prompts ---------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        keys = [message_key(m) for m in messages]
        tools_key = json.dumps(tools, sort_keys=True) if tools else ""
        for call in reversed(self.turns):
            for t in call:
                k = len(t.chat_key or ())
                if t.chat_key is not None and t.tools_key == tools_key \
                        and len(keys) >= k and keys[:k] == t.chat_key:
                    self.spliced += 1
                    return t.ids + self.r.continuation(messages[k:], t)
        sampled = {t.chat_key[-1]: t.completion.text for call in self.turns for t in call
                   if t.chat_key is not None}
        return self.r.chat(messages, tools, sampled)

    def text_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        for call in reversed(self.turns):
            for t in call:
                if t.text is not None and prompt.startswith(t.text):
                    self.spliced += 1
                    return t.ids + self.r.text(prompt[len(t.text):], first=False)
        return self.r.text(prompt, first=True)

    # -- records ---------------------------------------------------------------------------
    def record(self, prompt_ids: list[int], completions: list, replies: list,
               messages: list[dict] | None = None, tools: list[dict] | None = None,
               prompt_text: str | None = None) -> None:
        """A finished call: its prompt ids, the engine's Completions, and what was returned
        for each (chat: the assistant message; completion: the text)."""
        if self.turns and self._parent(prompt_ids) is None:
            self.prefix_breaks += 1
        keys = [message_key(m) for m in messages] if messages is not None else None
        tools_key = json.dumps(tools, sort_keys=True) if tools else ""
        call = []
        for c, reply in zip(completions, replies):
            t = _Turn(prompt_ids, c, tools_key=tools_key)
            if keys is not None:
                t.chat_key = keys + [message_key(reply)]
            elif isinstance(prompt_text, str):
                t.text = prompt_text + reply
            call.append(t)
        self.turns.append(call)

    def _parent(self, prompt_ids: list[int]) -> _Turn | None:
        """The latest recorded turn whose prompt + sampled ids begin `prompt_ids`."""
        return self._parent_before(prompt_ids, len(self.turns))[0]

    @property
    def calls(self) -> int:
        return len(self.turns)

    def sample(self, version: int) -> tuple[Sample, dict]:
        """The episode's training sequence and its counts. `version`: for Completions that
        carry no version spans (batch mode). An episode without calls is an empty sample."""
        counts = {"prefix_breaks": self.prefix_breaks, "spliced_calls": self.spliced,
                  "model_calls": self.calls, "dropped_sampled_tokens": 0}
        sample = Sample()
        if not self.turns:
            return sample, counts
        chain = [self.turns[-1][0]]
        at = len(self.turns) - 1
        while True:  # back through the calls each one extends
            parent, at = self._parent_before(chain[-1].prompt_ids, at)
            if parent is None:
                break
            chain.append(parent)
        chain.reverse()
        done: list[int] = []
        for t in chain:
            sample.add_context(t.prompt_ids[len(done):])
            sample.add_completion(t.completion, version)
            done = t.ids
        total = sum(len(t.completion.token_ids) for call in self.turns for t in call)
        counts["dropped_sampled_tokens"] = total - sum(len(t.completion.token_ids)
                                                       for t in chain)
        return sample, counts

    def _parent_before(self, prompt_ids: list[int], at: int) -> tuple[_Turn | None, int]:
        """The latest turn of calls [0, at) whose prompt + sampled ids begin `prompt_ids`,
        and its call's index."""
        for i in range(at - 1, -1, -1):
            for t in self.turns[i]:
                ids = t.ids
                if len(ids) <= len(prompt_ids) and prompt_ids[:len(ids)] == ids:
                    return t, i
        return None, -1
