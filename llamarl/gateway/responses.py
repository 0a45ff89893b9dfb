"""OpenAI response bodies from the engine's Completions, with vLLM's own tool-call parsers.

Chat: each choice's text (the sampled ids decoded, special tokens skipped; cut at the first
stop string, if the request had any) goes through the parser rollout.tool_parser names
(vllm.tool_parsers: hermes, llama3_json, mistral, ...), when the request has tools and
tool_choice is not "none". Calls found become the message's `tool_calls` (finish reason
"tool_calls"), the rest its content. Logprobs, when asked, are the sampled tokens' own
(top_logprobs empty).
"""

from __future__ import annotations

import itertools
import time

# response and tool-call ids: unique per process (os.urandom per id cost ~90 us on the CPU box)
_IDS = itertools.count()


def tool_parser(name: str, tokenizer):
    """An instance of vLLM's parser `name`, or None for "none"; ValueError naming the key
    for an unknown one."""
    if name == "none":
        return None
    from vllm.tool_parsers import ToolParserManager

    try:
        cls = ToolParserManager.get_tool_parser(name)
    except KeyError:
        names = ", ".join(sorted(ToolParserManager.list_registered()))
        raise ValueError(f"recipe key 'rollout.tool_parser' = {name!r}: not one of vLLM's "
                         f"tool parsers ({names}), or none") from None
    return cls(tokenizer)


def forced_call_prefix(parser_name: str, choice: str, forced: str | None) -> str:
    """What a reply that must call a tool (tool_choice required, or a named function) begins
    with, written in the model's own tool-call format (rollout.tool_parser): the gateway puts
    it in the prompt and the model samples the rest. Sampling stays the plain softmax (the
    trainer reproduces it: the prefix is context, like a chat template's glue), where
    constrained decoding would mask the distribution. hermes: `<tool_call>\n{"name": "` (the
    model picks the tool), `... "name": "<name>", "arguments": ` (it writes the arguments).
    ValueError for a parser whose format has no such prefix here."""
    if choice not in ("required", "function"):
        return ""
    if parser_name != "hermes":
        raise ValueError(f"tool_choice {choice!r} is served by writing the start of the call "
                         f"into the prompt in the model's format, known for rollout.tool_parser "
                         f"hermes, not {parser_name!r}: use auto")
    head = '<tool_call>\n{"name": "'
    return head + (f'{forced}", "arguments": ' if forced else "")


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """`text` up to its first stop string, and whether one was found."""
    at = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text, False) if at < 0 else (text[:at], True)


def _finish(c, stopped: bool) -> str:
    return "stop" if stopped or c.finish_reason == "stop" else "length"


def _logprobs(tokenizer, c) -> list[dict]:
    out = []
    for tid, lp in zip(c.token_ids, c.logprobs):
        tok = tokenizer.decode([tid])
        out.append({"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")),
                    "top_logprobs": []})
    return out


def _usage(prompt_ids: list[int], completions: list) -> dict:
    done = sum(len(c.token_ids) for c in completions)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": done,
            "total_tokens": len(prompt_ids) + done}


def chat_message(text: str, parser, tools, tool_choice: str, model: str
                 ) -> tuple[dict, bool, int]:
    """The assistant message for `text`, whether it holds tool calls, and how many calls it
    made to tools the request did not offer. Such a reply is returned as its text (content),
    not as tool calls: an OpenAI-compatible server only ever calls the request's tools (the
    harness sees the model's answer, and the trainer its reward)."""
    if parser is None or not tools or tool_choice == "none":
        return {"role": "assistant", "content": text}, False, 0
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    # (parsed as under auto: a forced call was prefilled, forced_call_prefix)
    request = ChatCompletionRequest(model=model, messages=[{"role": "user", "content": ""}],
                                    tools=tools, tool_choice="auto")
    info = parser.extract_tool_calls(text, request)
    if not info.tools_called:
        return {"role": "assistant", "content": text}, False, 0
    offered = {t["function"]["name"] for t in tools}
    unknown = sum(tc.function.name not in offered for tc in info.tool_calls)
    if unknown:
        return {"role": "assistant", "content": text}, False, unknown
    calls = [{"id": f"call_{next(_IDS)}", "type": "function",
              "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
             for tc in info.tool_calls]
    return {"role": "assistant", "content": info.content or None, "tool_calls": calls}, True, 0


def chat_response(req, prompt_ids, completions, parser, tokenizer, model: str,
                  prefix: str = "") -> tuple[dict, list[dict], int]:
    """The chat.completion body, each choice's message as the capture keys it (tool call
    arguments as objects, as requests.py reads them back), and the calls to tools the
    request did not offer (returned as text: chat_message). `prefix`: the forced call's
    start the prompt ended with (forced_call_prefix): the reply's text begins with it."""
    import json

    choices, keyed, unknown = [], [], 0
    for i, c in enumerate(completions):
        text, stopped = cut_at_stop(c.text, req.sampling.stop)
        text = prefix + text
        message, called, bad = chat_message(text, parser, req.tools, req.tool_choice, model)
        unknown += bad
        choice = {"index": i, "message": message,
                  "finish_reason": "tool_calls" if called else _finish(c, stopped),
                  "logprobs": {"content": _logprobs(tokenizer, c)} if req.sampling.logprobs
                  else None}
        choices.append(choice)
        key = dict(message)
        if called:
            key["tool_calls"] = [{"function": {"name": tc["function"]["name"],
                                               "arguments": _args(tc["function"]["arguments"],
                                                                  json)}}
                                 for tc in message["tool_calls"]]
        keyed.append(key)
    body = {"id": f"chatcmpl-{next(_IDS)}", "object": "chat.completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": _usage(prompt_ids, completions)}
    return body, keyed, unknown


def _args(arguments: str, json):
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def completion_response(req, prompt_ids, completions, tokenizer, model: str
                        ) -> tuple[dict, list[str]]:
    """The text_completion body, and each choice's returned text."""
    choices, texts = [], []
    for i, c in enumerate(completions):
        text, stopped = cut_at_stop(c.text, req.sampling.stop)
        lps = None
        if req.sampling.logprobs:
            toks = [tokenizer.decode([t]) for t in c.token_ids]
            lps = {"tokens": toks, "token_logprobs": list(c.logprobs),
                   "top_logprobs": None, "text_offset": None}
        choices.append({"index": i, "text": text, "finish_reason": _finish(c, stopped),
                        "logprobs": lps})
        texts.append(text)
    body = {"id": f"cmpl-{next(_IDS)}", "object": "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": _usage(prompt_ids, completions)}
    return body, texts


def generate_response(req, prompt_ids, completions, tokenizer, model: str, version: int
                      ) -> dict:
    """vLLM's GenerateTokensResponse (or GenerateTextResponse, output_mode "text") for the
    engine's Completions: every sampled id (a stop string's included, as vLLM keeps them in
    token_ids), the sampled tokens' logprobs when asked, the weight versions that sampled
    them (`version` for a Completion without spans)."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        GenerateLogProbs,
        GenerateLogProbsContent,
        GenerateTextChoice,
        GenerateTextResponse,
        GenerateTokensChoice,
        GenerateTokensResponse,
    )
    from vllm.outputs import WeightVersionSpan

    choices = []
    for i, c in enumerate(completions):
        text, stopped = cut_at_stop(c.text, req.sampling.stop)
        spans, at = [], 0
        for n, v in (c.versions or [(len(c.token_ids), version)]):
            spans.append(WeightVersionSpan(version=str(v), start=at, end=at + n))
            at += n
        common = {"index": i, "finish_reason": _finish(c, stopped),
                  "stop_reason": next((s for s in req.sampling.stop if s in c.text), None),
                  "token_ids": list(c.token_ids), "weight_versions": spans}
        if req.text:
            lps = {"content": _logprobs(tokenizer, c)} if req.sampling.logprobs else None
            choices.append(GenerateTextChoice(**common, text=text, logprobs=lps))
        else:
            lps = GenerateLogProbs(content=[
                GenerateLogProbsContent(token_id=t, logprob=lp, rank=None)
                for t, lp in zip(c.token_ids, c.logprobs)]) if req.sampling.logprobs else None
            choices.append(GenerateTokensChoice(**common, logprobs=lps))
    cls = GenerateTextResponse if req.text else GenerateTokensResponse
    body = cls(request_id=req.request_id, model=model, created=int(time.time()),
               usage=_usage(prompt_ids, completions), choices=choices,
               prompt_token_ids=list(prompt_ids) if req.return_token_ids else None)
    return body.model_dump(mode="json")
