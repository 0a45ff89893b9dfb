"""What the gateway accepts: OpenAI request bodies checked into typed requests, and the
OpenAI-style errors it answers with.

Every refusal is a GatewayError: an HTTP status and the body OpenAI's API sends,
{"error": {"message", "type", "param", "code"}}, so the `openai` client raises its own
BadRequestError / AuthenticationError / NotFoundError with the message.

Sampling: the gateway samples exactly as the training sampler does (plain softmax at the
collection's temperature, top_p 1, no penalties), because the trainer recomputes the
logprobs of that distribution. A request that asks for another distribution (temperature
other than generator.temperature, top_p != 1, penalties, logit_bias, top_logprobs) is
refused with a 400 naming the parameter, not served "off-policy": its tokens would train
with logprobs the trainer cannot reproduce, silently. tool_choice required or a named
function is served without constrained decoding: the start of the call is written into the
prompt in the model's format, and the model samples the rest (responses.py:
forced_call_prefix). Parameters that do not change the distribution (seed, user,
parallel_tool_calls, ...) are accepted and ignored. `stream` is answered as server-sent
events (streaming.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

MAX_N = 16
ROLES = ("system", "developer", "user", "assistant", "tool")


class GatewayError(Exception):
    """A request the gateway refuses: `status` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = \
            status, message, param, code, type_

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class Sampling:
    """What both endpoints share: choices, the token budget, stop strings, logprobs."""

    n: int = 1
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    stream: bool = False  # answered as server-sent events (streaming.py)
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage


@dataclass
class ChatRequest:
    messages: list[dict]
    tools: list[dict] | None
    tool_choice: str  # "auto" | "none" | "required" | "function": a call of `forced`
    sampling: Sampling
    forced: str | None = None  # tool_choice "function": the tool the reply must call


@dataclass
class CompletionRequest:
    prompt: str | list[int]
    sampling: Sampling


@dataclass
class GenerateCall:
    """POST /inference/v1/generate (vLLM's token-in / token-out endpoint): `token_ids` is the
    prompt as given; `text`: output_mode "text" (decoded text and logprobs with token strings
    beside the ids); `request_id`: echoed back."""

    token_ids: list[int]
    sampling: Sampling
    text: bool
    request_id: str
    return_token_ids: bool


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GatewayError(400, f"the request body is not valid JSON ({e})",
                           code="invalid_json") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object",
                           code="invalid_json")
    return body


def _bad(param: str, what: str) -> GatewayError:
    return GatewayError(400, f"{param}: {what}", param=param, code="invalid_value")


def _sampling(body: dict, model: str, temperature: float, chat: bool) -> Sampling:
    if body.get("model") != model:
        raise GatewayError(404, f"The model {body.get('model')!r} does not exist: this "
                           f"gateway serves {model!r} (GET /v1/models)", param="model",
                           code="model_not_found")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise _bad("stream", f"{stream!r}: must be true or false")
    options = body.get("stream_options")
    if options is not None and not (stream and isinstance(options, dict)):
        raise _bad("stream_options", "an object, and only with stream: true")
    t = body.get("temperature")
    if t is not None and (not isinstance(t, (int, float)) or abs(t - temperature) > 1e-6):
        raise _bad("temperature", f"{t!r}: the policy trains on samples at "
                   f"generator.temperature = {temperature:g}; leave temperature out or "
                   "set it to that (another temperature would train on logprobs the trainer "
                   "cannot reproduce)")
    top_p = body.get("top_p")
    if top_p is not None and top_p != 1:
        raise _bad("top_p", f"{top_p!r}: the training sampler uses top_p = 1; leave it out")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name):
            raise _bad(name, f"{body[name]!r}: penalties change the sampled distribution; "
                       "leave it out or 0")
    if body.get("logit_bias"):
        raise _bad("logit_bias", "changes the sampled distribution; leave it out")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise _bad("n", f"{n!r}: must be an integer in [1, {MAX_N}]")
    max_tokens = None
    for name in ("max_completion_tokens", "max_tokens"):
        v = body.get(name)
        if v is not None:
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise _bad(name, f"{v!r}: must be an integer >= 1")
            max_tokens = v if max_tokens is None else min(max_tokens, v)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and len(stop) <= 4
            and all(isinstance(s, str) and s for s in stop)):
        raise _bad("stop", f"{body.get('stop')!r}: a non-empty string or a list of up to 4")
    if chat:
        logprobs = body.get("logprobs") or False
        if not isinstance(logprobs, bool):
            raise _bad("logprobs", f"{logprobs!r}: must be true or false")
        if body.get("top_logprobs"):
            raise _bad("top_logprobs", "only the sampled tokens' logprobs are served; leave "
                       "it out or 0")
    else:
        lp = body.get("logprobs")
        if lp not in (None, 0, 1) or isinstance(lp, bool):
            raise _bad("logprobs", f"{lp!r}: only the sampled tokens' logprobs are served "
                       "(0 or 1)")
        logprobs = lp is not None
    return Sampling(n, max_tokens, stop, logprobs, stream,
                    bool((options or {}).get("include_usage")))


def _content(message: dict, i: int) -> str | None:
    """A message's content as text: a string, None, or a list of text parts."""
    c = message.get("content")
    if c is None or isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for part in c:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise _bad(f"messages[{i}].content", "only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content", "must be a string, null or a list of text parts")


def parse_messages(raw) -> list[dict]:
    """Messages as the template reads them. A tool result must answer a call an earlier
    assistant turn made (its tool_call_id among theirs), as OpenAI's API requires; one without
    an id is taken as it is."""
    if not isinstance(raw, list) or not raw:
        raise _bad("messages", "must be a non-empty list of messages")
    out, call_ids = [], set()
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"messages[{i}]", f"needs a role, one of {', '.join(ROLES)}")
        msg = {"role": m["role"], "content": _content(m, i)}
        if m["role"] == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
            call_ids.update(c["id"] for c in msg["tool_calls"] if c["id"] is not None)
        if m["role"] == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = str(m["tool_call_id"])
            if msg["tool_call_id"] not in call_ids:
                raise _bad(f"messages[{i}].tool_call_id",
                           f"{msg['tool_call_id']!r} answers no tool call of an earlier "
                           "assistant message: send the assistant turn with its tool_calls "
                           "before their results")
        if m.get("name") is not None and m["role"] != "assistant":
            msg["name"] = str(m["name"])
        out.append(msg)
    return out


def _tool_calls(raw, i: int) -> list[dict]:
    """An assistant message's tool calls, with the arguments as the template reads them
    (a dict; OpenAI sends a JSON string)."""
    if not isinstance(raw, list):
        raise _bad(f"messages[{i}].tool_calls", "must be a list")
    out = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"messages[{i}].tool_calls[{j}]", "needs function.name")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise _bad(f"messages[{i}].tool_calls[{j}].function.arguments",
                           "is not valid JSON") from None
        out.append({"id": None if call.get("id") is None else str(call["id"]),
                    "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _tools(raw) -> list[dict] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise _bad("tools", "must be a list of {type: function, function: {...}}")
    for i, tool in enumerate(raw):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function"
                and isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise _bad(f"tools[{i}]", "must be {type: function, function: {name, "
                       "description, parameters}}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        _check_schema(params, f"tools[{i}].function.parameters")
    return raw


def _check_schema(schema, param: str) -> None:
    """A tool's parameters must be a JSON Schema (checked against its meta-schema)."""
    import jsonschema

    if not isinstance(schema, dict):
        raise _bad(param, f"{schema!r} is not a JSON Schema (an object)")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise _bad(param, f"is not a valid JSON Schema: {e.message}") from None


def chat_request(body: dict, model: str, temperature: float) -> ChatRequest:
    sampling = _sampling(body, model, temperature, chat=True)
    messages = parse_messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    choice, forced = _tool_choice(body.get("tool_choice"), tools)
    return ChatRequest(messages, tools, choice, sampling, forced)


def _tool_choice(choice, tools: list[dict] | None) -> tuple[str, str | None]:
    """tool_choice as (auto | none | required | function, the named tool): a named function
    as chat ({"type": "function", "function": {"name"}}) or Responses ({"type": "function",
    "name"}) write it. required and a named one need tools (and the named one among them)."""
    if choice is None:
        return "auto", None
    names = [t["function"]["name"] for t in tools or []]
    if choice in ("auto", "none"):
        return choice, None
    if choice == "required":
        if not names:
            raise _bad("tool_choice", "required needs tools")
        return "required", None
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else choice.get("name")
    if not isinstance(name, str):
        raise _bad("tool_choice", f"{choice!r}: auto, none, required or "
                   '{"type": "function", "function": {"name": ...}}')
    if name not in names:
        raise _bad("tool_choice", f"names {name!r}, which is not among the tools "
                   f"({', '.join(names) or 'none given'})")
    return "function", name


def completion_request(body: dict, model: str, temperature: float) -> CompletionRequest:
    sampling = _sampling(body, model, temperature, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                 for t in prompt):
            raise _bad("prompt", "a string, or a non-empty list of token ids (one prompt "
                       "per request)")
    elif not isinstance(prompt, str) or not prompt:
        raise _bad("prompt", "a non-empty string, or a list of token ids (one prompt per "
                   "request)")
    if body.get("echo"):
        raise _bad("echo", "not supported; leave it false")
    if body.get("suffix"):
        raise _bad("suffix", "not supported; leave it out")
    return CompletionRequest(prompt, sampling)


# SamplingParams fields that change the sampled distribution (or what a sample is), with the
# value the training sampler has: a request must leave them at it (see the module doc)
_GENERATE_FIXED = {"top_p": 1.0, "top_k": (0, -1), "min_p": 0.0, "presence_penalty": 0.0,
                   "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0,
                   "ignore_eos": False, "logit_bias": (None, {}),
                   "allowed_token_ids": (None, []), "bad_words": (None, []),
                   "structured_outputs": None, "prompt_logprobs": None,
                   "stop_token_ids": (None, []), "logprob_token_ids": None,
                   "thinking_token_budget": None}


def generate_request(body: dict, model: str, temperature: float) -> GenerateCall:
    """vLLM 0.32's GenerateRequest (vllm/entrypoints/scale_out/token_in_token_out/protocol.py),
    validated by vLLM's own class, then held to the training sampler: 400 naming the field
    for anything else."""
    from pydantic import ValidationError
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
    from vllm.exceptions import VLLMValidationError

    if body.get("model") is not None and body.get("model") != model:
        raise GatewayError(404, f"The model {body.get('model')!r} does not exist: this "
                           f"gateway serves {model!r} (GET /v1/models)", param="model",
                           code="model_not_found")
    if not isinstance(body.get("sampling_params"), dict):
        raise _bad("sampling_params", "an object of vLLM SamplingParams fields is required "
                   "(e.g. {\"max_tokens\": 64})")
    try:
        req = GenerateRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"] if x != "is-instance[SamplingParams]")
        raise _bad(where or "body", err["msg"]) from None
    except (VLLMValidationError, ValueError) as e:  # SamplingParams' own checks
        param = getattr(e, "parameter", None)
        raise _bad(f"sampling_params.{param}" if param else "sampling_params",
                   str(e).split(" (parameter=")[0]) from None
    sp = req.sampling_params
    if req.is_sampling_param_provided("temperature") and abs(sp.temperature - temperature) > 1e-6:
        raise _bad("sampling_params.temperature", f"{sp.temperature!r}: the policy trains on "
                   f"samples at generator.temperature = {temperature:g}; leave it out or set "
                   "it to that")
    for name, allowed in _GENERATE_FIXED.items():
        value = getattr(sp, name, None)
        ok = value in allowed if isinstance(allowed, tuple) else value == allowed
        if not ok:
            raise _bad(f"sampling_params.{name}", f"{value!r}: changes what the training "
                       f"sampler samples; leave it out (the trainer could not reproduce the "
                       "logprobs)")
    if sp.logprobs not in (None, 0):
        raise _bad("sampling_params.logprobs", f"{sp.logprobs!r}: only the sampled tokens' "
                   "logprobs are served (0)")
    if not 1 <= sp.n <= MAX_N:
        raise _bad("sampling_params.n", f"{sp.n!r}: must be an integer in [1, {MAX_N}]")
    if req.features is not None or req.content_parts:
        raise _bad("features", "multimodal inputs are not served; send token_ids alone")
    stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
    max_tokens = sp.max_tokens if req.is_sampling_param_provided("max_tokens") else None
    options = req.stream_options
    sampling = Sampling(sp.n, max_tokens, stop, sp.logprobs is not None, bool(req.stream),
                        bool(options is not None and options.include_usage))
    return GenerateCall(list(req.token_ids), sampling, req.output_mode == "text",
                        req.request_id, bool(req.return_token_ids))
