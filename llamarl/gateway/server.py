"""The HTTP server: FastAPI on uvicorn, in a thread of the generator process.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models
                                 ("stream": true: server-sent events, streaming.py)
    POST /v1/messages           (the Anthropic Messages dialect: messages.py)
    POST /v1/responses          (the OpenAI Responses dialect: responses_api.py)
    POST /inference/v1/generate (vLLM's token-in / token-out endpoint, at the server's root:
                                 base_url without /v1)

The server thread only parses and checks requests (requests.py) and authenticates them; it
never touches vLLM. A checked request becomes a `GatewayCall` on a thread-safe queue, which
the generator's loop (rollout/agent_source.py) drains between engine steps: it renders the
prompt, submits it to the Engine, keeps stepping, and resolves the call's future with the
response when its samples finish. So the engine steps while agents think, and every engine
call stays on the generator's own thread.

Authentication: every request carries `Authorization: Bearer <key>`. The run has a random
token; each episode gets its own key, `<token>.<episode secret>`, which is also how a call
is attributed to its episode (the agent's client is built with it). A request without the
run's token is a 401; a key of an episode that has ended (timed out, failed) is a 403.
GET /v1/models takes the run's token alone.
"""

from __future__ import annotations

import asyncio
import hmac
import queue
import re
import secrets
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from fastapi import Request  # (module level: FastAPI resolves the handlers' annotations here)

from llamarl.gateway.messages import (
    anthropic_error,
    messages_events,
    messages_request,
    messages_response,
)
from llamarl.gateway.requests import (
    GatewayError,
    chat_request,
    completion_request,
    error_body,
    generate_request,
    parse_json,
    parse_messages,
)
from llamarl.gateway.responses_api import response_body, response_events, responses_request
from llamarl.gateway.streaming import chat_chunks, completion_chunks, generate_chunks

# POST path -> the kind of call it is (serve)
_ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion",
           "/v1/responses": "responses", "/v1/messages": "messages",
           "/inference/v1/generate": "generate"}
_CHECKS = {"chat": chat_request, "completion": completion_request,
           "generate": generate_request, "messages": messages_request}  # kind -> its request check

START_TIMEOUT_S = 30.0


@dataclass
class GatewayCall:
    """One checked request for the generator's loop: `kind` "chat", "completion" or
    "generate", `request` its ChatRequest / CompletionRequest / GenerateCall; `future`
    resolves to (status, body)."""

    episode: int
    kind: str
    request: object
    future: Future


class Gateway:
    """The gateway of one engine. `model`: the name it serves; `temperature`: the training
    sampler's (requests.py). start() binds and serves; close() stops the thread."""

    def __init__(self, model: str, temperature: float, host: str = "127.0.0.1",
                 port: int = 0):
        self.model, self.temperature = model, temperature
        self.host, self.port = host, port
        self.token = secrets.token_urlsafe(24)
        self.calls: queue.SimpleQueue[GatewayCall] = queue.SimpleQueue()
        self._episodes: dict[str, int] = {}  # episode key -> episode id
        # episode key -> its /v1/responses conversations (response id -> the chat messages
        # with the reply), for previous_response_id; dropped with the episode
        self._conversations: dict[str, dict[str, list[dict]]] = {}
        self._waiting: set[Future] = set()  # futures of calls not answered yet
        self._lock = threading.Lock()
        self._server = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self.requests = 0  # HTTP requests answered, refusals included
        self.refused = 0
        # 4xx answers by reason (refusal_reason) since the generator's loop last took them
        # (take_refusals), and the message of each reason's first answer
        self._refusals: dict[str, int] = {}
        self.reason_messages: dict[str, str] = {}

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    # -- episodes --------------------------------------------------------------------------
    def open_episode(self, episode: int) -> str:
        """A new API key for `episode`: its calls are attributed to it until close_episode."""
        key = f"{self.token}.{secrets.token_hex(8)}"
        with self._lock:
            self._episodes[key] = episode
        return key

    def close_episode(self, key: str) -> None:
        with self._lock:
            self._episodes.pop(key, None)
            self._conversations.pop(key, None)

    def _conversation(self, key: str, response_id: str) -> list[dict] | None:
        with self._lock:
            return self._conversations.get(key, {}).get(response_id)

    def _keep_conversation(self, key: str, response_id: str, messages: list[dict]) -> None:
        with self._lock:
            if key in self._episodes:
                self._conversations.setdefault(key, {})[response_id] = messages

    def _authorize(self, header: str | None, episode: bool) -> int | None:
        key = (header or "").removeprefix("Bearer ").strip()
        token, _, _ = key.partition(".")
        if not hmac.compare_digest(token.encode(), self.token.encode()):
            raise GatewayError(401, "Incorrect API key provided: use the key your agent's "
                               "client was given", code="invalid_api_key",
                               type_="authentication_error")
        if not episode:
            return None
        with self._lock:
            eid = self._episodes.get(key)
        if eid is None:
            raise GatewayError(403, "this key belongs to no live episode (it ended: a "
                               "timeout, an error, or its result was returned)",
                               code="episode_ended", type_="permission_error")
        return eid

    # -- refusals --------------------------------------------------------------------------
    def _count(self, status: int, body: dict) -> None:
        """Count a 4xx answer by its reason (a 5xx is the gateway's, not the request's)."""
        self.refused += 1
        if not 400 <= status < 500:
            return
        error = body.get("error") or {}
        reason = refusal_reason(status, error)
        with self._lock:
            self._refusals[reason] = self._refusals.get(reason, 0) + 1
            self.reason_messages.setdefault(reason, str(error.get("message", "")))

    def take_refusals(self) -> dict[str, int]:
        """The 4xx answers by reason since the last call (the generator's loop, per step)."""
        with self._lock:
            out, self._refusals = self._refusals, {}
        return out

    # -- the server ------------------------------------------------------------------------
    def _app(self):
        from fastapi import FastAPI
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, StreamingResponse
        from starlette.exceptions import HTTPException

        app = FastAPI(title="llamarl gateway", docs_url=None, redoc_url=None,
                      openapi_url=None)

        def answer(body: dict, status: int, dialect: str = "openai") -> JSONResponse:
            """`body` (OpenAI's shape) as `status`; a refusal is counted, and in the
            Messages dialect sent in Anthropic's error shape."""
            if status != 200:
                self._count(status, body)
                if dialect == "messages":
                    error = body.get("error") or {}
                    body = anthropic_error(status, str(error.get("message", "")),
                                           str(error.get("type", "")))
            return JSONResponse(body, status_code=status)

        def refuse(e: GatewayError) -> JSONResponse:
            return answer(e.body(), e.status)

        @app.exception_handler(HTTPException)
        async def http_error(request, exc):  # unknown routes, wrong methods
            return answer(error_body(str(exc.detail), "invalid_request_error",
                                     code="unknown_route" if exc.status_code == 404 else None),
                          exc.status_code)

        @app.exception_handler(RequestValidationError)
        async def invalid(request, exc):
            return answer(error_body(str(exc), "invalid_request_error"), 400)

        @app.exception_handler(Exception)
        async def internal_error(request, exc):  # a bug of ours: the request fails alone
            return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}",
                                           "server_error"), status_code=500)

        @app.get("/v1/models")
        async def models(request: Request):
            self.requests += 1
            try:
                self._authorize(request.headers.get("authorization"), episode=False)
            except GatewayError as e:
                return refuse(e)
            return {"object": "list", "data": [{"id": self.model, "object": "model",
                                                "created": 0, "owned_by": "llamarl"}]}

        async def serve(request: Request, kind: str):
            """`kind`: chat, completion, generate, responses or messages (the Responses and
            Messages dialects: chat calls for the generator, answered in their own shapes:
            responses_api.py, messages.py)."""
            self.requests += 1
            dialect = "messages" if kind == "messages" else "openai"
            try:  # (the anthropic SDK sends its key as x-api-key)
                key = (request.headers.get("authorization") or request.headers.get("x-api-key")
                       or "").removeprefix("Bearer ").strip()
                eid = self._authorize(key, episode=True)
                body = parse_json(await request.body())
                if kind == "responses":
                    checked, responses_req = responses_request(
                        body, self.model, self.temperature,
                        lambda rid: self._conversation(key, rid))
                else:
                    checked = _CHECKS[kind](body, self.model, self.temperature)
            except GatewayError as e:
                return answer(e.body(), e.status, dialect)
            if self._closing:
                e = GatewayError(503, "the gateway is shutting down", type_="server_error")
                return answer(e.body(), e.status, dialect)
            dialect_kind, kind = kind, "chat" if kind in ("messages", "responses") else kind
            future: Future = Future()
            with self._lock:
                self._waiting.add(future)
            self.calls.put(GatewayCall(eid, kind, checked, future))
            try:
                status, out = await asyncio.wrap_future(future)
            finally:
                with self._lock:
                    self._waiting.discard(future)
            if status != 200:
                return answer(out, status, dialect)
            stream = getattr(checked.sampling, "stream", False)
            if dialect_kind == "responses":
                answered = response_body(responses_req, out, self.temperature)
                if responses_req.store is not False:
                    self._keep_conversation(key, answered["id"], checked.messages + parse_messages(
                        [out["choices"][0]["message"]]))
                if stream:
                    return StreamingResponse(iter(response_events(answered)),
                                             media_type="text/event-stream")
                return answer(answered, 200)
            if dialect == "messages":
                if stream:
                    return StreamingResponse(messages_events(chat_chunks(out, True)),
                                             media_type="text/event-stream")
                return answer(messages_response(out), 200)
            if stream:
                events = {"chat": chat_chunks, "completion": completion_chunks,
                          "generate": generate_chunks}[kind](out,
                                                             checked.sampling.include_usage)
                return StreamingResponse(iter(events), media_type="text/event-stream")
            return answer(out, status)

        def route(kind: str):
            async def handler(request: Request):
                return await serve(request, kind)
            return handler

        for path, kind in _ROUTES.items():
            app.post(path)(route(kind))

        return app

    def start(self) -> None:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise ValueError(f"recipe key 'rollout.gateway_port' = {self.port}: cannot bind "
                             f"{self.host}:{self.port} ({e}); use 0 for any free port") from e
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False,
                                lifespan="off", timeout_keep_alive=30,
                                timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="llamarl-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent gateway did not start on {self.host}:"
                                   f"{self.port}")
            time.sleep(0.01)

    def close(self) -> None:
        """Stop serving: calls queued, in the engine (episodes stopped with the run) or
        arriving now are answered 503, then the server stops."""
        self._closing = True
        self._answer_queued()
        with self._lock:
            waiting = list(self._waiting)
        for future in waiting:
            if not future.done():
                future.set_result((503, error_body("the gateway is shutting down",
                                                   "server_error")))
        if self._server is not None:
            time.sleep(0.05)  # (a request past the flag's check is queued by now)
            self._answer_queued()
            self._server.should_exit = True
            self._thread.join(10)
            self._server = None

    def _answer_queued(self) -> None:
        while True:
            try:
                call = self.calls.get_nowait()
            except queue.Empty:
                return
            resolve(call, 503, error_body("the gateway is shutting down", "server_error"))


def refusal_reason(status: int, error: dict) -> str:
    """A 4xx answer's reason as a metric name: status, code (or type), and the parameter
    named, e.g. 400_invalid_prompt, 400_invalid_value_temperature, 401_invalid_api_key."""
    parts = [str(status), error.get("code") or error.get("type") or "error"]
    if error.get("param"):
        parts.append(str(error["param"]))
    return re.sub(r"[^A-Za-z0-9_.\[\]]+", "_", "_".join(parts))


def resolve(call: GatewayCall, status: int, body: dict) -> None:
    """Answer `call` (from the generator's loop); a second answer is ignored."""
    if not call.future.done():
        call.future.set_result((status, body))
