"""Server-sent events for `"stream": true`: a finished response body as the chunks each
vendor's SDK reads, with vLLM's protocol classes for the OpenAI shapes.

    chat.completion.chunk   role delta, content deltas (one per token when logprobs were
                            asked, with its logprob entry; else one), tool-call deltas (one per
                            call: id, name and the whole arguments), a finish delta, a usage
                            chunk when stream_options.include_usage, then `data: [DONE]`
    text_completion         text deltas (the same rule), a finish chunk, usage, [DONE]

The events are written once the call's samples have finished: the engine reports finished
samples (generator/engine.py: RequestOutputKind.FINAL_ONLY), so a stream carries the whole
reply at once rather than token by token as it is sampled. A client that drops the stream
ends only its own request (the samples still train; nothing else is sent to it).
"""

from __future__ import annotations

import json


def sse(data: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


DONE = sse("[DONE]")


def _pieces(text: str | None, logprobs: list[dict] | None) -> list[tuple[str, list | None]]:
    """A reply's text as stream deltas: per token with its logprob entry when there are
    logprobs whose tokens spell the text, else the text whole, with every logprob (an empty
    text too: a reply of EOS alone, or of tool calls alone, still streams its logprobs)."""
    if logprobs and text and "".join(lp["token"] for lp in logprobs) == text:
        return [(lp["token"], [lp]) for lp in logprobs]
    return [(text or "", logprobs)] if text or logprobs else []


def chat_chunks(body: dict, include_usage: bool) -> list[str]:
    """The chat.completion `body` (responses.chat_response) as its stream's events."""
    from vllm.entrypoints.generate.base.protocol import (
        DeltaFunctionCall,
        DeltaMessage,
        DeltaToolCall,
    )
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionLogProbs,
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
    )

    def chunk(choice: dict, delta, finish=None, logprobs=None) -> str:
        c = ChatCompletionResponseStreamChoice(
            index=choice["index"], delta=delta, finish_reason=finish,
            logprobs=None if logprobs is None else
            ChatCompletionLogProbs.model_validate({"content": logprobs}))
        r = ChatCompletionStreamResponse(id=body["id"], object="chat.completion.chunk",
                                         created=body["created"], model=body["model"],
                                         choices=[c])
        return sse(r.model_dump(mode="json", exclude_unset=True))

    out = []
    for choice in body["choices"]:
        msg = choice["message"]
        out.append(chunk(choice, DeltaMessage(role="assistant", content="")))
        lps = (choice.get("logprobs") or {}).get("content")
        for text, lp in _pieces(msg.get("content"), lps):
            out.append(chunk(choice, DeltaMessage(content=text), logprobs=lp))
        for i, call in enumerate(msg.get("tool_calls") or []):
            out.append(chunk(choice, DeltaMessage(tool_calls=[DeltaToolCall(
                index=i, id=call["id"], type="function",
                function=DeltaFunctionCall(name=call["function"]["name"],
                                           arguments=call["function"]["arguments"]))])))
        out.append(chunk(choice, DeltaMessage(), finish=choice["finish_reason"]))
    if include_usage:
        out.append(sse({"id": body["id"], "object": "chat.completion.chunk",
                        "created": body["created"], "model": body["model"], "choices": [],
                        "usage": body["usage"]}))
    return out + [DONE]


def completion_chunks(body: dict, include_usage: bool) -> list[str]:
    """The text_completion `body` (responses.completion_response) as its stream's events."""
    def chunk(index: int, text: str, finish=None, logprobs=None) -> str:
        return sse({"id": body["id"], "object": "text_completion",
                    "created": body["created"], "model": body["model"],
                    "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                 "finish_reason": finish}]})

    out = []
    for choice in body["choices"]:
        lp = choice.get("logprobs")
        if lp:  # per token, its logprob with it
            pieces = [(t, {"tokens": [t], "token_logprobs": [x], "top_logprobs": None,
                           "text_offset": None})
                      for t, x in zip(lp["tokens"], lp["token_logprobs"])]
            if "".join(t for t, _ in pieces) != choice["text"]:
                pieces = [(choice["text"], lp)]
        else:
            pieces = [(choice["text"], None)] if choice["text"] else []
        if lp and not pieces:
            pieces = [("", lp)]
        for text, piece_lp in pieces:
            out.append(chunk(choice["index"], text, logprobs=piece_lp))
        out.append(chunk(choice["index"], "", finish=choice["finish_reason"]))
    if include_usage:
        out.append(sse({"id": body["id"], "object": "text_completion",
                        "created": body["created"], "model": body["model"], "choices": [],
                        "usage": body["usage"]}))
    return out + [DONE]


def generate_chunks(body: dict, include_usage: bool) -> list[str]:
    """The /inference/v1/generate body (responses.generate_response) as vLLM's stream: per
    choice one GenerateTokensStreamResponse (or Text) chunk with its ids (and logprobs, text),
    finish reason and weight versions, the prompt ids on the first chunk when asked, a usage
    chunk when stream_options.include_usage, then [DONE]."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        GenerateTextStreamChoice,
        GenerateTextStreamResponse,
        GenerateTokensStreamChoice,
        GenerateTokensStreamResponse,
    )

    text = body.get("output_mode") == "text"
    response = GenerateTextStreamResponse if text else GenerateTokensStreamResponse
    choice_cls = GenerateTextStreamChoice if text else GenerateTokensStreamChoice
    out = []
    for k, choice in enumerate(body["choices"]):
        fields = {f: choice.get(f) for f in ("index", "finish_reason", "stop_reason",
                                             "token_ids", "logprobs", "weight_versions")}
        if text:
            fields["text"] = choice["text"]
        chunk = response(request_id=body["request_id"], choices=[choice_cls(**fields)],
                         prompt_token_ids=body.get("prompt_token_ids") if k == 0 else None)
        out.append(sse(chunk.model_dump(mode="json", exclude_none=True)))
    if include_usage:
        out.append(sse(response(request_id=body["request_id"], choices=[],
                                usage=body["usage"]).model_dump(mode="json",
                                                                exclude_none=True)))
    return out + [DONE]
