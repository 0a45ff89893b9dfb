"""The Tinker service's routes (FastAPI) and its start: `python -m llamarl.service RECIPE`
(docs/service.md). The state and the worker behind the routes: service/api.py."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request  # (module level: FastAPI reads the annotations here)
from fastapi.responses import JSONResponse, Response

from llamarl.service.api import TinkerService, adam_of, load_state, spec_of
from llamarl.service.wire import (
    PROTOBUF,
    decode_forward_backward,
    decompress,
    forward_backward_output,
)

API = "/api/v1"


def build_app(svc: TinkerService):
    app = FastAPI(title="llamarl Tinker service")

    def bad(reason: str, status: int = 400) -> JSONResponse:
        return JSONResponse({"detail": reason}, status_code=status)

    async def body_of(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(decompress(raw, request.headers.get("content-encoding")) or b"{}")
        except ValueError as e:
            raise _Bad(f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise _Bad("the body is not a JSON object")
        return body

    def queued(request_id: str, **extra) -> dict:
        return {"request_id": request_id, **extra}

    def need(body: dict, key: str):
        if key not in body or body[key] is None:
            raise _Bad(f"the request has no {key!r}")
        return body[key]

    # a malformed submission: one line, 400 (an unknown model or session: 404)
    @app.exception_handler(_Bad)
    @app.exception_handler(ValueError)
    async def _bad_request(request, exc):
        return bad(str(exc))

    @app.exception_handler(KeyError)
    async def _not_found(request, exc):
        return bad(str(exc).strip("'\""), 404)

    # --- service ---------------------------------------------------------------------------

    @app.api_route(API + "/healthz", methods=["GET", "POST"])
    async def healthz():
        return {"status": "ok"}

    @app.api_route(API + "/client/config", methods=["GET", "POST"])
    async def client_config():
        # one fwd/bwd request at a time per client (the worker runs them in arrival order),
        # uncompressed bodies are fine on a local server, and the plain httpx transport
        return {"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": False,
                "proto_compress_fwdbwd": False, "use_pyqwest_transport": False}

    @app.api_route(API + "/client/dynamic_config", methods=["GET", "POST"])
    async def dynamic_config():
        return {"refresh_interval_sec": 300}

    @app.api_route(API + "/get_server_capabilities", methods=["GET", "POST"])
    async def capabilities():
        return {"supported_models": [{"model_name": svc.base_model, "trainable": True,
                                      "sampleable": svc.sampler is not None,
                                      "max_context_length": svc.max_context}]}

    @app.post(API + "/telemetry")
    async def telemetry():
        return {"status": "accepted"}  # (the SDK's usage telemetry: not kept)

    @app.post(API + "/create_session")
    async def create_session(request: Request):
        await body_of(request)
        return {"type": "create_session", "session_id": svc.create_session(),
                "info_message": f"llamarl: {svc.base_model}, LoRA tenants up to "
                                f"{svc.tenants.max_tenants}"}

    @app.post(API + "/session_heartbeat")
    async def heartbeat(request: Request):
        try:
            svc.touch(need(await body_of(request), "session_id"))
        except KeyError as e:  # (410: the SDK stops that session's heartbeats, 404 it retries)
            return bad(str(e).strip("'\""), 410)
        return {"type": "session_heartbeat"}

    @app.api_route(API + "/sessions/{session_id}/finish", methods=["POST", "PUT"])
    async def finish(session_id: str):
        svc.end_session(session_id)
        return {}

    # --- training --------------------------------------------------------------------------

    @app.post(API + "/create_model")
    async def create_model(request: Request):
        body = await body_of(request)
        session_id, n = need(body, "session_id"), int(need(body, "model_seq_id"))
        svc.touch(session_id)
        if body.get("base_model") not in (None, svc.base_model):
            raise _Bad(f"base_model {body['base_model']!r}: this server trains "
                       f"{svc.base_model!r} (one base per server)")
        spec = spec_of(body.get("lora_config"), default_seed=n)
        svc.check_spec(spec)  # (a rank the sampler cannot serve: 400 now)
        model_id = f"{session_id}:train:{n}"
        rid = svc.submit("create_model", model_id, 0,
                         lambda: svc.create_model(session_id, n, spec))
        return queued(rid, model_id=model_id)

    @app.post(API + "/get_info")
    async def get_info(request: Request):
        model_id = need(await body_of(request), "model_id")
        spec = svc.tenants.get(svc.tenant_of(model_id)).spec
        return {"type": "get_info", "model_id": model_id, "model_name": svc.base_model,
                "is_lora": True, "lora_rank": spec.rank,
                "model_data": {"arch": "llamarl", "model_name": svc.base_model,
                               "tokenizer_id": svc.tokenizer_id}}

    @app.post(API + "/weights_info")
    async def weights_info(request: Request):
        body = await body_of(request)
        meta = json.loads((svc.resolve(need(body, "tinker_path"), "checkpoint")
                           / "meta.json").read_text())
        spec = meta.get("spec", {})
        return {"base_model": svc.base_model, "is_lora": True, "lora_rank": spec.get("rank")}

    @app.post(API + "/forward_backward")
    async def forward_backward(request: Request):
        if PROTOBUF not in request.headers.get("content-type", ""):
            raise _Bad(f"forward_backward takes a protobuf body ({PROTOBUF}), as the tinker "
                       "SDK sends it")
        raw = decompress(await request.body(), request.headers.get("content-encoding"))
        model_id, seq_id, loss_fn, config, data, forward_only = decode_forward_backward(raw)
        backward = not forward_only
        name = svc.tenant_of(model_id)
        svc.tenants.check(data, loss_fn, config)  # a bad batch: 400 now, not a failed future
        proto = True  # (the SDK's retrieve asks for protobuf for this type)

        def run():
            out = svc.tenants.forward(name, data, loss_fn, config, backward=backward)
            metrics = {"loss:sum": out.loss,
                       "num_tokens:sum": float(sum(len(d.tokens) for d in data))}
            return forward_backward_output(out.logprobs, metrics, proto)

        rid = svc.submit("forward_backward" if backward else "forward", model_id, seq_id, run)
        return queued(rid, model_id=model_id)

    def model_call(body: dict, route: str, run) -> dict:
        """Queue `run` as the body's model's call number body["seq_id"]."""
        model_id = body["model_id"]
        return queued(svc.submit(route, model_id, body.get("seq_id"), run), model_id=model_id)

    @app.post(API + "/optim_step")
    async def optim_step(request: Request):
        body = await body_of(request)
        model_id = need(body, "model_id")
        name, step = svc.tenant_of(model_id), adam_of(body)
        return model_call(body, "optim_step",
                          lambda: {"metrics": svc.tenants.optim_step(name, step)})

    @app.post(API + "/save_weights")
    async def save_weights(request: Request):
        body = await body_of(request)
        model_id = need(body, "model_id")
        svc.tenant_of(model_id)
        svc.checkpoint_dir(model_id, "weights", body.get("path"), body.get("seq_id"))
        return model_call(body, "save_weights",
                          lambda: svc.save_state(model_id, body.get("path"), body.get("seq_id")))

    @app.post(API + "/save_weights_for_sampler")
    async def save_for_sampler(request: Request):
        body = await body_of(request)
        model_id = need(body, "model_id")
        svc.tenant_of(model_id)
        name = body.get("path") or None
        if name is None:  # save_weights_and_get_sampling_client: a sampling client of it
            sampling()
            need(body, "sampling_session_seq_id")
        else:
            svc.checkpoint_dir(model_id, "sampler_weights", name, body.get("seq_id"))
        return model_call(body, "save_weights_for_sampler",
                          lambda: svc.save_for_sampler(model_id, name, body.get("seq_id"),
                                                       body.get("sampling_session_seq_id")))

    @app.post(API + "/load_weights")
    async def load_weights(request: Request):
        body = await body_of(request)
        path, with_optimizer = need(body, "path"), bool(body.get("optimizer"))
        directory = svc.resolve(path, "state")
        if body.get("model_id"):  # into an existing model
            model_id = body["model_id"]
            name = svc.tenant_of(model_id)

            def run():
                svc.tenants.load_state(name, load_state(directory, with_optimizer),
                                       with_optimizer)
                return {"path": path, "type": "load_weights"}

            rid = svc.submit("load_weights", model_id, body.get("seq_id"), run)
            return queued(rid, model_id=model_id)
        # a new training client from a saved state (create_training_client_from_state)
        session_id, n = need(body, "session_id"), int(need(body, "model_seq_id"))
        svc.touch(session_id)
        model_id = f"{session_id}:train:{n}"
        meta = json.loads((directory / "meta.json").read_text())

        def create():
            from llamarl.service.tenants import LoraSpec

            state = load_state(directory, with_optimizer)
            svc.create_model(session_id, n, LoraSpec(**meta["spec"]), state)
            return {"path": path, "type": "load_weights"}

        rid = svc.submit("load_weights", model_id, 0, create)
        return queued(rid, model_id=model_id)

    # --- sampling --------------------------------------------------------------------------

    def sampling():
        if svc.sampler is None:
            raise _Bad("this server was started without sampling (service.sampling: false): "
                       "start it with service.sampling=true to sample")

    @app.post(API + "/create_sampling_session")
    async def create_sampling_session(request: Request):
        body = await body_of(request)
        sampling()
        session_id = need(body, "session_id")
        svc.touch(session_id)
        path = body.get("model_path")
        if body.get("base_model") not in (None, svc.base_model):
            raise _Bad(f"base_model {body['base_model']!r}: this server samples "
                       f"{svc.base_model!r} (one base per server)")
        adapter = None
        if path:
            adapter = svc.resolve(path, "sampler weights")
            if not (adapter / "adapter_model.safetensors").is_file():
                raise _Bad(f"{path!r} is not sampler weights: give a path returned by "
                           "save_weights_for_sampler")
        sampler_id = svc.add_sampler(session_id, need(body, "sampling_session_seq_id"),
                                     adapter)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @app.get(API + "/samplers/{sampler_id}")
    async def sampler_info(sampler_id: str):
        adapter = svc.adapter_of(sampler_id)
        return {"sampler_id": sampler_id, "base_model": svc.base_model,
                "model_path": None if adapter is None else str(adapter)}

    # --- the RestClient's listing (service/runs.py): runs, checkpoints, sessions ------------

    @app.get(API + "/training_runs")
    async def training_runs(limit: int | None = None, offset: int | None = None):
        return svc.training_runs(limit, offset)

    @app.get(API + "/training_runs/{model_id}")
    async def training_run(model_id: str):
        return svc.training_run(model_id)

    @app.get(API + "/training_runs/{model_id}/checkpoints")
    async def run_checkpoints(model_id: str):
        return svc.checkpoints(model_id)

    @app.delete(API + "/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str):
        svc.delete_checkpoint(model_id, checkpoint_id)
        return Response(status_code=204)

    @app.get(API + "/checkpoints")
    async def all_checkpoints(limit: int | None = None, offset: int | None = None):
        return svc.checkpoints(None, limit, offset)

    @app.get(API + "/sessions")
    async def sessions(limit: int | None = None, offset: int | None = None):
        return svc.session_ids(limit, offset)

    @app.get(API + "/sessions/{session_id}")
    async def session(session_id: str):
        return svc.session_info(session_id)

    @app.post(API + "/asample")
    async def asample(request: Request):
        from llamarl.service.sampler import SampleJob, check_sample

        body = await body_of(request)
        sampling()
        sampler_id = need(body, "sampling_session_id")
        adapter = svc.adapter_of(sampler_id)
        prompt = []
        for chunk in (need(body, "prompt").get("chunks") or []):
            if chunk.get("type", "encoded_text") != "encoded_text":
                raise _Bad(f"a {chunk.get('type')} chunk: this server samples a text model, "
                           "give encoded_text chunks")
            prompt += [int(t) for t in chunk.get("tokens", [])]
        n = int(body.get("num_samples", 1))
        params = dict(body.get("sampling_params") or {})
        want_prompt = bool(body.get("prompt_logprobs"))
        for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(key):
                raise _Bad(f"{key} is not served here: ask for 0")
        check_sample(prompt, n, params, svc.sampler.vocab, svc.sampler.max_model_len)
        seq_id = body.get("seq_id")
        rid = svc.submit("asample", sampler_id, seq_id,
                         SampleJob(prompt, n, params, adapter, want_prompt))
        return queued(rid, sample_sequence_ids=[f"{sampler_id}:{seq_id}:{i}"
                                                for i in range(n)])

    @app.post(API + "/retrieve_future")
    async def retrieve_future(request: Request):
        request_id = need(await body_of(request), "request_id")
        future = await svc.retrieve(request_id)
        if future is None:
            return bad(f"no request {request_id!r} on this server", 404)
        if not future.done.is_set():
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        if future.error is not None:
            return {"error": future.error, "category": future.category}
        if isinstance(future.result, bytes):
            return Response(future.result, media_type=PROTOBUF)
        return future.result

    return app


class _Bad(Exception):
    """A malformed submission: answered 400 with this line."""


@dataclass
class Served:
    """A bound, not yet serving, service: `serve()` runs until interrupted (or `stop()`)."""

    service: TinkerService
    server: object  # uvicorn.Server
    sock: object  # its bound socket
    url: str

    def serve(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.service.close()

    def stop(self) -> None:
        self.server.should_exit = True


def main(argv: list[str]) -> int:
    """python -m llamarl.service RECIPE [key=value ...]: load model.path once and serve it.
    Under torchrun with N ranks: rank 0 serves, ranks 1..N-1 follow it (service/ranks.py)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0] + "\nusage: [torchrun --nproc-per-node N -m | "
              "python -m] llamarl.service RECIPE [key=value ...]", file=sys.stderr)
        return 2
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        if dist.get_rank() > 0:
            return _follow(argv[0], argv[1:])
    try:
        served = start(argv[0], argv[1:])
    except ValueError as e:
        print(f"llamarl service: {e}", file=sys.stderr, flush=True)
        if world > 1:
            _stop_followers()
        return 1
    print(f"llamarl service: {served.url}  (export TINKER_BASE_URL={served.url}; "
          f"base_model={served.service.base_model!r}"
          + (f"; {world} trainer ranks" if world > 1 else "") + ")", flush=True)
    try:
        served.serve()
    except KeyboardInterrupt:
        pass
    finally:
        if world > 1:
            served.service.tenants.stop()
    return 0


def _follow(recipe: str, overrides: list[str]) -> int:
    """A trainer rank > 0: the tenants' replicas, run as rank 0 says (service/ranks.py)."""
    import signal

    from llamarl.config import load_config
    from llamarl.service.ranks import follow

    # Ctrl-C reaches every rank, and torchrun then sends SIGTERM: a follower waits for rank
    # 0's stop instead (rank 0 stops on either signal and sends it), so no rank dies inside a
    # collective the others are in. (A rank 0 that died: torchrun's SIGKILL ends this one.)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        cfg = load_config(recipe, overrides)
        tenants = load_tenants(cfg)[0]
    except ValueError:
        _stop_followers()  # (receives rank 0's stop: rank 0 fails on the same recipe, says
        # why and stops every rank)
        return 1
    follow(tenants)
    return 0


def _stop_followers() -> None:
    """Rank 0 failed to start: the stop that ends the followers (on a follower: received)."""
    import torch.distributed as dist

    dist.broadcast_object_list([("stop",)], src=0)


def load_tenants(cfg):
    """The recipe's base model with room for its tenants; -> (LoraTenants, tokenizer, the
    model's local directory, the context: a datum's positions at most)."""
    from llamarl.service.model import load_base
    from llamarl.service.tenants import LoraTenants

    svc_cfg = cfg.service
    model, tokenizer, path = load_base(cfg.model.path, cfg.model.dtype)
    context = min(svc_cfg.max_tokens, getattr(model.config, "max_position_embeddings",
                                               svc_cfg.max_tokens))
    tenants = LoraTenants(model, svc_cfg.max_tenants, context,
                          tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                          else tokenizer.eos_token_id, svc_cfg.micro_batch_tokens)
    return tenants, tokenizer, path, context


def start(recipe: str, overrides: list[str]) -> Served:
    """Load the recipe's model, build the service and bind its port (not yet serving). In a
    world of several ranks (this is rank 0), the tenants are replicated on the others."""
    import socket

    import torch.distributed as dist
    import uvicorn

    from llamarl.config import load_config

    cfg = load_config(recipe, overrides)
    svc_cfg = cfg.service
    tenants, tokenizer, path, context = load_tenants(cfg)
    if dist.is_initialized() and dist.get_world_size() > 1:
        from llamarl.service.ranks import ReplicatedTenants

        tenants = ReplicatedTenants(tenants)
    sampler = None
    if svc_cfg.sampling:
        import torch

        from llamarl.service.sampler import Sampler

        merge = (svc_cfg.sampling_lora == "merged" or svc_cfg.sampling_lora == "auto"
                 and not torch.cuda.is_available())
        sampler = Sampler(path, cfg.model.dtype, context, svc_cfg.max_tenants,
                          svc_cfg.max_lora_rank, int(svc_cfg.kv_cache_gib * (1 << 30)),
                          cfg.run.seed, merge)
    directory = Path(svc_cfg.dir or Path(cfg.run.output_dir) / cfg.run.name / "service")
    svc = TinkerService(tenants, cfg.model.path, path, directory, svc_cfg.session_timeout_s,
                        context, sampler, svc_cfg.max_lora_rank)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((svc_cfg.host, svc_cfg.port))
    except OSError as e:
        raise ValueError(f"service.port {svc_cfg.port} on {svc_cfg.host}: {e.strerror}: "
                         "give another (0 = a free one)") from None
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(svc), log_level="warning"))
    return Served(svc, server, sock, f"http://{svc_cfg.host}:{port}")
