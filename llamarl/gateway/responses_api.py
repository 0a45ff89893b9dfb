"""The Responses dialect: POST /v1/responses (the OpenAI Responses API with function tools and
`previous_response_id`), on vLLM 0.32's own protocol classes and converters
(vllm/entrypoints/openai/responses/).

A request is validated by vLLM's ResponsesRequest and turned into chat messages by vLLM's
construct_input_messages (instructions -> system; input messages; `function_call` items ->
the assistant's tool_calls, merged with the message item before them; `function_call_output`
-> tool messages; a previous response's conversation first, its system message left out as the
API says) and its tools by construct_tool_dicts; then it is checked as a chat request
(requests.py: chat_request, the training sampler's rules). So a Responses call is a chat call
for the generator: rendered or spliced the same way (capture.py), token-exact.

The answer is a ResponsesResponse (vLLM's, built by its from_request): the reply's text as a
`message` item with one `output_text`, each tool call as a `function_call` item (its call_id
the chat reply's tool-call id), status `incomplete` when the reply hit its token budget. The
gateway keeps each response's conversation (the chat messages and the reply) for the episode
that made it, so a later call of the same episode may continue it by `previous_response_id`;
they are dropped when the episode ends.

`"stream": true` is answered as the Responses API's events (response.created, .in_progress,
per item output_item.added / content_part / output_text.delta / function_call_arguments /
output_item.done, response.completed), written once the call's samples finish (as chat
streams: streaming.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from llamarl.gateway.requests import ChatRequest, GatewayError, _bad, chat_request

# Responses-API parameters the training sampler cannot honour (beside the chat ones)
_REFUSED = {"top_k": (None, 0, -1), "min_p": (None, 0, 0.0), "background": (None, False),
            "reasoning": (None,), "prompt": (None,)}


def responses_request(body: dict, model: str, temperature: float,
                      previous: Callable[[str], list[dict] | None]) -> tuple[ChatRequest,
                                                                             object]:
    """The chat request of a Responses request, and vLLM's ResponsesRequest (for the answer).
    `previous(response_id)`: the conversation of an earlier response of this episode, or None.
    """
    from pydantic import ValidationError
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import (
        construct_input_messages,
        construct_tool_dicts,
    )
    from vllm.exceptions import VLLMValidationError

    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        raise _bad(".".join(str(x) for x in err["loc"]) or "body",
                   err["msg"].removeprefix("Value error, ")) from None
    except VLLMValidationError as e:  # vLLM's own checks of the request
        raise _bad(getattr(e, "parameter", None) or "body",
                   str(e).split(" (parameter=")[0]) from None
    for name, allowed in _REFUSED.items():
        if getattr(req, name) not in allowed:
            raise _bad(name, f"{getattr(req, name)!r}: not served by the training sampler; "
                       "leave it out")
    fmt = getattr(getattr(req.text, "format", None), "type", "text") if req.text else "text"
    if fmt != "text":
        raise _bad("text.format", f"{fmt!r}: structured output needs constrained decoding, "
                   "which changes the sampled distribution; leave it out")
    if req.top_logprobs:
        raise _bad("top_logprobs", "only the sampled tokens' logprobs are served; leave it "
                   "out or 0")
    history = None
    if req.previous_response_id is not None:
        history = previous(req.previous_response_id)
        if history is None:
            raise GatewayError(404, f"Previous response with id "
                               f"'{req.previous_response_id}' not found (a response of this "
                               "episode is kept until the episode ends)",
                               param="previous_response_id", code="not_found")
    messages = construct_input_messages(request_instructions=req.instructions,
                                        request_input=req.input, prev_msg=history)
    choice = req.tool_choice
    if not isinstance(choice, str):
        choice = choice.model_dump(exclude_none=True)
    tools = construct_tool_dicts(req.tools, req.tool_choice)
    chat = chat_request({
        "model": req.model, "messages": json.loads(json.dumps(messages, default=_plain)),
        "tools": tools, "tool_choice": choice, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "logit_bias": req.logit_bias, "stream": bool(req.stream),
    }, model, temperature)
    return chat, req


def _plain(x):
    """vLLM's messages may hold openai TypedDicts and pydantic parts: as plain JSON."""
    return x.model_dump(exclude_none=True) if hasattr(x, "model_dump") else str(x)


def response_body(req, chat_body: dict, temperature: float) -> dict:
    """The ResponsesResponse of a chat.completion body (its first choice)."""
    from openai.types.responses import (
        ResponseFunctionToolCall,
        ResponseOutputMessage,
        ResponseOutputText,
    )
    from vllm.entrypoints.openai.responses.protocol import ResponsesResponse, ResponseUsage
    from vllm.sampling_params import SamplingParams

    choice = chat_body["choices"][0]
    msg, n = choice["message"], chat_body["id"].rpartition("-")[2]
    output = []
    if msg.get("content") or not msg.get("tool_calls"):
        output.append(ResponseOutputMessage(
            id=f"msg_{n}", type="message", role="assistant", status="completed",
            content=[ResponseOutputText(type="output_text", text=msg.get("content") or "",
                                        annotations=[])]))
    for call in msg.get("tool_calls") or []:
        output.append(ResponseFunctionToolCall(
            id=f"fc_{call['id'].removeprefix('call_')}", type="function_call",
            call_id=call["id"], name=call["function"]["name"],
            arguments=call["function"]["arguments"], status="completed"))
    usage = chat_body["usage"]
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    sampling = SamplingParams(temperature=temperature, top_p=1.0,
                              max_tokens=max(usage["completion_tokens"], 1))
    body = ResponsesResponse.from_request(
        req, sampling, chat_body["model"], int(time.time()), output, status,
        usage=ResponseUsage(input_tokens=usage["prompt_tokens"],
                            output_tokens=usage["completion_tokens"],
                            total_tokens=usage["total_tokens"],
                            input_tokens_details={"cached_tokens": 0, "cache_write_tokens": 0},
                            output_tokens_details={"reasoning_tokens": 0}))
    return body.model_dump(mode="json", exclude_none=True)


def response_events(body: dict) -> list[str]:
    """A ResponsesResponse as the Responses API's stream events (server-sent events with an
    `event:` line each, as OpenAI sends them)."""
    events: list[dict] = []

    def add(kind: str, **fields) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    pending = {**body, "status": "in_progress", "output": [], "usage": None}
    add("response.created", response=pending)
    add("response.in_progress", response=pending)
    for i, item in enumerate(body["output"]):
        if item["type"] == "message":
            add("response.output_item.added", output_index=i,
                item={**item, "status": "in_progress", "content": []})
            for j, part in enumerate(item["content"]):
                ids = {"item_id": item["id"], "output_index": i, "content_index": j}
                add("response.content_part.added", **ids,
                    part={**part, "text": ""})
                add("response.output_text.delta", **ids, delta=part["text"], logprobs=[])
                add("response.output_text.done", **ids, text=part["text"], logprobs=[])
                add("response.content_part.done", **ids, part=part)
        else:  # function_call
            add("response.output_item.added", output_index=i,
                item={**item, "status": "in_progress", "arguments": ""})
            ids = {"item_id": item["id"], "output_index": i}
            add("response.function_call_arguments.delta", **ids, delta=item["arguments"])
            add("response.function_call_arguments.done", **ids, arguments=item["arguments"],
                name=item["name"])
        add("response.output_item.done", output_index=i, item=item)
    add("response.completed" if body["status"] == "completed" else "response.incomplete",
        response=body)
    return [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events]
