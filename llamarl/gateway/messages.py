"""The Anthropic Messages dialect: POST /v1/messages, on vLLM 0.32's own protocol classes and
converters (vllm/entrypoints/anthropic/).

A request is validated by vLLM's AnthropicMessagesRequest, turned into an OpenAI chat request
by vLLM's AnthropicServingMessages.to_chat_completion_request (system, text, tool_use and
tool_result blocks -> system / user / assistant tool_calls / tool messages), and checked as a
chat request (requests.py: chat_request, the training sampler's rules). So a Messages call is
a chat call for the generator: rendered or spliced the same way (capture.py), token-exact.
The chat.completion body it is answered with goes back through vLLM's converters: the full
message (messages_full_converter) or its stream (message_stream_converter: message_start,
content_block_start / _delta / _stop per text and tool_use block, message_delta, message_stop).
Both converters read nothing of their instance (checked against vLLM 0.32.0), so they are
called on the class.

Errors are Anthropic's shape, {"type": "error", "error": {"type", "message"}}, which the
`anthropic` SDK raises as its own BadRequestError / AuthenticationError / NotFoundError.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from llamarl.gateway.requests import ChatRequest, GatewayError, _bad, chat_request


def messages_request(body: dict, model: str, temperature: float) -> ChatRequest:
    """A Messages request as the chat request it is (400 naming the field otherwise)."""
    from pydantic import ValidationError
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    if body.get("model") != model:
        raise GatewayError(404, f"The model {body.get('model')!r} does not exist: this "
                           f"gateway serves {model!r}", param="model", code="not_found_error",
                           type_="not_found_error")
    from vllm.exceptions import VLLMValidationError

    try:
        req = AnthropicMessagesRequest.model_validate(body)
    except VLLMValidationError as e:  # vLLM's own checks of the request
        raise _bad(getattr(e, "parameter", None) or "body",
                   str(e).split(" (parameter=")[0]) from None
    except ValidationError as e:
        err = e.errors()[0]
        raise _bad(".".join(str(x) for x in err["loc"]) or "body",
                   err["msg"].removeprefix("Value error, ")) from None
    thinking = getattr(req.thinking, "type", "disabled") if req.thinking else "disabled"
    if thinking != "disabled":
        raise _bad("thinking", f"{thinking!r}: extended thinking is not served; leave it out")
    if req.top_k not in (None, 0, -1):
        raise _bad("top_k", f"{req.top_k!r}: the training sampler uses no top-k; leave it out")
    if req.output_config is not None and req.output_config.format is not None:
        raise _bad("output_config.format", "structured output needs constrained decoding, "
                   "which changes the sampled distribution; leave it out")
    chat = AnthropicServingMessages.to_chat_completion_request(req)
    choice = chat.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = choice.model_dump(exclude_none=True)
    return chat_request({
        "model": model, "messages": chat.messages,
        "tools": [t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools else None,
        "tool_choice": choice, "max_tokens": req.max_tokens, "stop": req.stop_sequences,
        "temperature": req.temperature, "top_p": req.top_p, "stream": bool(req.stream),
        "stream_options": {"include_usage": True} if req.stream else None,
    }, model, temperature)


def messages_response(chat_body: dict) -> dict:
    """The Anthropic message for a chat.completion body (its first choice)."""
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    full = AnthropicServingMessages.messages_full_converter(
        None, ChatCompletionResponse.model_validate(chat_body))
    return full.model_dump(mode="json", exclude_none=True)


async def messages_events(chat_events: list[str]) -> AsyncIterator[str]:
    """The Anthropic stream for a chat.completion's stream events (streaming.chat_chunks)."""
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    async def chunks():
        for event in chat_events:
            yield event

    async for event in AnthropicServingMessages.message_stream_converter(None, chunks()):
        yield event


def anthropic_error(status: int, message: str, type_: str) -> dict:
    """An error body as Anthropic's API sends it (`type_` one of its error types)."""
    kinds = {400: "invalid_request_error", 401: "authentication_error",
             403: "permission_error", 404: "not_found_error", 413: "request_too_large",
             429: "rate_limit_error", 503: "overloaded_error"}
    return {"type": "error", "error": {"type": kinds.get(status, type_ or "api_error"),
                                       "message": message}}
