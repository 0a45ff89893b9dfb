"""The HTTP API the Tinker SDK calls (`tinker.ServiceClient(base_url=...)`), on FastAPI, with
the tenants of service/tenants.py behind it (docs/service.md).

The SDK's protocol, as read from tinker 0.38 (`tinker/resources/`, `lib/api_future_impl.py`):

* a session (`create_session`, `session_heartbeat` every few seconds) owns training clients
  (`create_model`: model id `<session>:train:<n>`); a session silent for
  service.session_timeout_s is ended and its models freed (their saved states stay);
* every training call is **submitted** (the answer is a future's `request_id` at once) and its
  result **retrieved** (`retrieve_future`, polled; here long-polled for up to LONG_POLL_S,
  then `{"type": "try_again"}`); a failed request resolves to `{"error", "category"}`, which
  the SDK raises as RequestFailedError; a malformed submission is a 400 with the reason;
* one training client submits its calls one at a time, in `seq_id` order (the SDK waits
  for each submission's answer before the next: `_take_turn`), and one worker thread runs
  every submitted call in arrival order, so a model's calls run in its order and an
  `optim_step` runs after the `forward_backward` calls before it; a retried submission
  (same model, same seq_id, same route) gets the first one's future back, not a second run;
* forward_backward arrives as the SDK's protobuf and its result goes back as protobuf
  (service/wire.py); the rest is JSON of the SDK's pydantic types.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llamarl.service.runs import RunStore, page, safe_name
from llamarl.service.sampler import SampleJob
from llamarl.service.tenants import AdamStep, LoraSpec, LoraTenants

LONG_POLL_S = 20.0  # a retrieve_future waits this long for its result (the SDK's own is 45 s)
TINKER_SCHEME = "tinker://"
SAMPLER_TAG = ":sample:"  # a sampling client's id: <session id>:sample:<its seq id>
EPHEMERAL = "ephemeral-"  # the name of an adapter saved for one sampling client
SAMPLE_QUIET_S = 0.02  # sample requests are gathered into one engine call until this quiet
SAMPLE_GATHER_S = 0.25  # ... for at most this long after the first
# a finished call's result is kept this long for the client to retrieve (the SDK retrieves
# at once and retries for minutes at most), then dropped: a server that runs for weeks would
# otherwise hold every result it ever sent (a sample's tokens, a forward's logprobs)
FUTURE_KEEP_S = 900.0
CLOSE_WAIT_S = 60.0  # close() waits this long for the job in progress (a sample call, a step)


@dataclass
class Future:
    """One submitted call: pending until the worker sets `result` (a dict for JSON, bytes for
    protobuf) or `error`."""

    done: threading.Event = field(default_factory=threading.Event)
    result: dict | bytes | None = None
    error: str | None = None
    category: str = "user"
    # the retrieve_future calls waiting on it: (their event loop, their asyncio.Event). A
    # long poll waits on the event loop, not on a thread: the SDK polls every future it
    # holds at once (a step's 16 sample requests, 128 in an evaluation), and a thread per
    # poll in the loop's small default pool queued them behind each other for minutes
    waiters: list = field(default_factory=list)
    finished_at: float | None = None  # time.monotonic() of finish(): pruned FUTURE_KEEP_S on
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def finish(self) -> None:
        """Called by the worker once `result` or `error` is set."""
        with self._lock:
            self.finished_at = time.monotonic()
            self.done.set()
            waiters, self.waiters = self.waiters, []
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    async def wait(self, timeout: float) -> None:
        """Until done or `timeout` seconds (on the running event loop)."""
        import asyncio

        event = asyncio.Event()
        with self._lock:
            if self.done.is_set():
                return
            self.waiters.append((asyncio.get_running_loop(), event))
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            with self._lock:
                self.waiters = [w for w in self.waiters if w[1] is not event]


@dataclass
class Session:
    last_seen: float
    models: list[str] = field(default_factory=list)


class TinkerService:
    """The server's state: sessions, models (model id -> tenant), futures and the worker that
    runs the calls. `base_model`: the name clients pass (and get_info reports);
    `tokenizer_id`: what the SDK's get_tokenizer loads (the model's local directory, so it
    works offline)."""

    def __init__(self, tenants: LoraTenants, base_model: str, tokenizer_id: str,
                 directory: Path, session_timeout_s: float, max_context: int,
                 sampler=None, max_lora_rank: int = 0):
        self.tenants, self.base_model, self.tokenizer_id = tenants, base_model, tokenizer_id
        self.sampler = sampler  # service/sampler.Sampler, or None: training only
        self.max_lora_rank = max_lora_rank
        # sampling client id -> the adapter directory it samples (None: the base)
        self.samplers: dict[str, Path | None] = {}
        self.directory, self.session_timeout_s = Path(directory), session_timeout_s
        self.max_context = max_context
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, str] = {}  # model id -> tenant (adapter) name
        self.last_request: dict[str, float] = {}  # model id -> time.time() of its last call
        self.runs = RunStore(self.directory)
        self.futures: dict[str, Future] = {}
        self.submitted: dict[tuple, str] = {}  # (route, model id, seq_id) -> request id
        self.lock = threading.Lock()
        self._ids = itertools.count(1)
        # (request id, what to run): a callable, or a SampleJob (batched with the sample jobs
        # queued right behind it); (None, callable): housekeeping; None: stop
        self._jobs: deque = deque()
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, daemon=True,
                                          name="llamarl-service-worker"),
                         threading.Thread(target=self._reap, daemon=True,
                                          name="llamarl-service-reaper")]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        """Stop the worker (after the job it is running) and the sampler's engine."""
        self._stop.set()
        self._put(None)
        self._threads[0].join(CLOSE_WAIT_S)
        if self.sampler is not None:
            self.sampler.close()

    def _put(self, job) -> None:
        with self._wake:
            self._jobs.append(job)
            self._wake.notify()

    def _take(self) -> list:
        """The next job, or the run of sample jobs at the head of the queue."""
        with self._wake:
            while not self._jobs:
                self._wake.wait()
            first = self._jobs.popleft()
            if first is None or not isinstance(first[1], SampleJob):
                return [first]
            # a loop's sample requests come as one HTTP request each, a few ms apart: gather
            # those that keep arriving (until SAMPLE_QUIET_S passes without one, at most
            # SAMPLE_GATHER_S) so they run as one engine call, not the first alone and then
            # the rest
            batch, deadline = [first], time.monotonic() + SAMPLE_GATHER_S
            while True:
                while self._jobs and self._jobs[0] is not None and isinstance(
                        self._jobs[0][1], SampleJob):
                    batch.append(self._jobs.popleft())
                left = deadline - time.monotonic()
                if self._jobs or left <= 0 or not self._wake.wait(min(SAMPLE_QUIET_S, left)):
                    return batch  # (another kind of job next, the deadline, or quiet)

    # --- futures -------------------------------------------------------------------------

    def submit(self, route: str, model_id: str | None, seq_id: int | None,
               run: Callable[[], dict | bytes] | SampleJob) -> str:
        """Queue `run` for the worker (a SampleJob: for the sampler); the request id of its
        future. A submission already seen (a retry) returns the first one's id."""
        key = (route, model_id, seq_id)
        with self.lock:
            if model_id is not None:
                self.last_request[model_id] = time.time()
            if seq_id is not None and key in self.submitted:
                return self.submitted[key]
            request_id = f"req-{next(self._ids)}"
            self.futures[request_id] = Future()
            if seq_id is not None:
                self.submitted[key] = request_id
        self._put((request_id, run))
        return request_id

    def _work(self) -> None:
        while not self._stop.is_set():
            jobs = self._take()
            if jobs[0] is None:
                return
            request_id, run = jobs[0]
            if request_id is None:  # housekeeping (a session's models dropped)
                run()
                continue
            futures = [self.futures[rid] for rid, _ in jobs]
            try:
                if isinstance(run, SampleJob):
                    results = self.sampler.sample([job for _, job in jobs])
                else:
                    results = [run()]
                for future, result in zip(futures, results):
                    future.result = result
            except (ValueError, KeyError) as e:  # the request's fault: told to its client
                for future in futures:
                    future.error = str(e).strip("'\"")
            except Exception as e:  # noqa: BLE001 - the server's fault: told, and it goes on
                for future in futures:
                    future.error, future.category = f"{type(e).__name__}: {e}", "server"
            for future in futures:
                future.finish()

    async def retrieve(self, request_id: str, timeout: float = LONG_POLL_S) -> Future | None:
        future = self.futures.get(request_id)
        if future is not None:
            await future.wait(timeout)
        return future

    # --- sessions ------------------------------------------------------------------------

    def create_session(self) -> str:
        with self.lock:
            session_id = f"s{next(self._ids)}-{int(time.time())}"
            self.sessions[session_id] = Session(time.monotonic())
            return session_id

    def touch(self, session_id: str) -> None:
        with self.lock:
            if session_id not in self.sessions:
                raise KeyError(f"no session {session_id!r} on this server (ended after "
                               f"{self.session_timeout_s:.0f} s without a heartbeat, or the "
                               "server restarted): start a new ServiceClient")
            self.sessions[session_id].last_seen = time.monotonic()

    def end_session(self, session_id: str) -> None:
        """The session's training clients freed, its sampling clients closed and the adapters
        saved for them alone (save_weights_and_get_sampling_client's, unnamed) deleted: a
        loop saves one a step, which a server running for weeks would otherwise keep."""
        with self.lock:
            session = self.sessions.pop(session_id, None)
            adapters = [self.samplers.pop(s) for s in self._samplers_of(session_id)]
        for model_id in session.models if session else ():
            self._put((None, lambda m=model_id: self._drop(m)))
        for adapter in adapters:
            if adapter is not None and adapter.name.startswith(EPHEMERAL):
                self._put((None, lambda a=adapter: shutil.rmtree(a, ignore_errors=True)))

    def _drop(self, model_id: str) -> None:
        with self.lock:
            name = self.models.pop(model_id, None)
            self.last_request.pop(model_id, None)
        if name is not None:
            self.tenants.remove(name)

    def prune_futures(self, now: float) -> int:
        """Drop the futures finished more than FUTURE_KEEP_S before `now` (and the retry
        keys that lead to them); -> how many."""
        with self.lock:
            old = {rid for rid, f in self.futures.items()
                   if f.finished_at is not None and now - f.finished_at > FUTURE_KEEP_S}
            for rid in old:
                del self.futures[rid]
            self.submitted = {k: rid for k, rid in self.submitted.items() if rid not in old}
        return len(old)

    def _reap(self) -> None:
        while not self._stop.wait(1.0):
            now = time.monotonic()
            self.prune_futures(now)
            with self.lock:
                gone = [s for s, v in self.sessions.items()
                        if now - v.last_seen > self.session_timeout_s]
            for session_id in gone:
                print(f"llamarl service: session {session_id} sent nothing for "
                      f"{self.session_timeout_s:.0f} s: ended, its training clients freed",
                      flush=True)
                self.end_session(session_id)

    # --- models --------------------------------------------------------------------------

    def tenant_of(self, model_id: str) -> str:
        with self.lock:
            name = self.models.get(model_id)
        if name is None:
            raise KeyError(f"no model {model_id!r} on this server: create it with "
                           "create_lora_training_client (a server restart or a session "
                           "timeout frees models: load their saved state)")
        return name

    def check_spec(self, spec: LoraSpec) -> None:
        """What the sampler cannot serve is refused when the client is made, not when it
        first samples."""
        if self.sampler is None:
            return
        if spec.rank > self.max_lora_rank:
            raise ValueError(f"lora rank {spec.rank}: this server samples adapters of rank <= "
                             f"{self.max_lora_rank} (service.max_lora_rank)")
        if spec.train_unembed and getattr(self.tenants.model.config, "tie_word_embeddings",
                                          False):
            # vLLM 0.32 adapts no head tied to the embeddings (its LoRA loader refuses an
            # lm_head adapter for such a model), so such an adapter could be trained but
            # never sampled as trained
            raise ValueError(f"train_unembed=True: {self.base_model} ties its output head to "
                             "its embeddings, and vLLM cannot sample a LoRA on a tied head: "
                             "pass train_unembed=False")

    def create_model(self, session_id: str, model_seq_id: int, spec: LoraSpec,
                     state: dict | None = None) -> dict:
        self.check_spec(spec)
        model_id = f"{session_id}:train:{model_seq_id}"
        name = f"t{next(self._ids)}"
        self.tenants.create(name, spec)
        if state is not None:
            try:
                self.tenants.load_state(name, state, with_optimizer="optimizer" in state)
            except BaseException:
                self.tenants.remove(name)
                raise
        with self.lock:
            self.models[model_id] = name
            self.last_request[model_id] = time.time()
            if session_id in self.sessions:
                self.sessions[session_id].models.append(model_id)
        return {"model_id": model_id, "type": "create_model"}

    # --- checkpoints ---------------------------------------------------------------------

    def checkpoint_dir(self, model_id: str, kind: str, name: str | None, seq_id) -> tuple[Path,
                                                                                        str]:
        """(directory, tinker path) of a checkpoint: `tinker://<model id>/<kind>/<name>`."""
        name = name or f"step{seq_id}"
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", name) or name in (".", ".."):
            raise ValueError(f"checkpoint name {name!r}: use letters, digits, '_', '-', '.'")
        return (self.directory / safe_name(model_id) / kind / name,
                f"{TINKER_SCHEME}{model_id}/{kind}/{name}")

    def resolve(self, path: str, kind: str) -> Path:
        """A tinker:// path (or a local directory) of a saved checkpoint."""
        if path.startswith(TINKER_SCHEME):
            model_id, _, rest = path[len(TINKER_SCHEME):].partition("/")
            local = self.directory / safe_name(model_id) / rest
        else:
            local = Path(path)
        if not (local / "meta.json").is_file():
            raise ValueError(f"no saved {kind} at {path!r}: give a path returned by "
                             f"save_state / save_weights_for_sampler on this server")
        return local

    def save_state(self, model_id: str, name: str | None, seq_id) -> dict:
        directory, path = self.checkpoint_dir(model_id, "weights", name, seq_id)
        state = self.tenants.state(self.tenant_of(model_id), with_optimizer=True)
        save_state(directory, state, model_id)
        return {"path": path, "type": "save_weights"}

    def save_for_sampler(self, model_id: str, name: str | None, seq_id,
                         sampling_seq_id: int | None = None) -> dict:
        """Write the tenant's adapter for the sampler: under `name` (a tinker path any
        sampling client can be made from), or, without a name, as the adapter of a new
        sampling client (`<session>:sample:<sampling_seq_id>`, the SDK's
        save_weights_and_get_sampling_client)."""
        from safetensors.torch import save_file

        ephemeral = name is None
        if ephemeral:
            name = f"{EPHEMERAL}{sampling_seq_id}-{seq_id}"
        directory, path = self.checkpoint_dir(model_id, "sampler_weights", name, seq_id)
        tenant = self.tenant_of(model_id)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.tenants.adapter_state(tenant).items()},
                  directory / "adapter_model.safetensors")
        (directory / "adapter_config.json").write_text(
            json.dumps(self.tenants.peft_config(tenant), indent=1))
        (directory / "meta.json").write_text(json.dumps(
            {"model_id": model_id, "spec": self.tenants.get(tenant).spec.__dict__}))
        if ephemeral:
            session_id = model_id.rsplit(":train:", 1)[0]
            sampler_id = self.add_sampler(session_id, sampling_seq_id, directory)
            return {"path": None, "sampling_session_id": sampler_id,
                    "type": "save_weights_for_sampler"}
        return {"path": path, "type": "save_weights_for_sampler"}

    def add_sampler(self, session_id: str, sampling_seq_id, adapter: Path | None) -> str:
        sampler_id = f"{session_id}{SAMPLER_TAG}{sampling_seq_id}"
        with self.lock:
            self.samplers[sampler_id] = adapter
        return sampler_id

    def _samplers_of(self, session_id: str) -> list[str]:
        """The session's sampling client ids (call holding `lock`)."""
        return [s for s in self.samplers if s.startswith(f"{session_id}{SAMPLER_TAG}")]

    def adapter_of(self, sampler_id: str) -> Path | None:
        with self.lock:
            if sampler_id not in self.samplers:
                raise KeyError(f"no sampling client {sampler_id!r} on this server: make one "
                               "(create_sampling_client, save_weights_and_get_sampling_client)")
            return self.samplers[sampler_id]

    # --- listing (the RestClient's routes: service/runs.py) --------------------------------

    def training_run(self, model_id: str) -> dict:
        with self.lock:
            name = self.models.get(model_id)
            when = self.last_request.get(model_id)
        live = (None if name is None else
                {"rank": self.tenants.get(name).spec.rank, "last_request": when})
        return self.runs.training_run(model_id, self.runs.run_dir(model_id), self.base_model,
                                      live)

    def training_runs(self, limit: int | None, offset: int | None) -> dict:
        """Live models and the runs saved on disk, the most recent first."""
        with self.lock:
            ids = set(self.models)
        ids |= set(self.runs.run_dirs())
        runs = sorted((self.training_run(m) for m in ids),
                      key=lambda r: r["last_request_time"], reverse=True)
        items, cursor = page(runs, limit, offset)
        return {"training_runs": items, "cursor": cursor}

    def checkpoints(self, model_id: str | None, limit=None, offset=None) -> dict:
        """One run's checkpoints (oldest first, as the SDK lists them), or with no model id
        every run's, the newest first, paged."""
        if model_id is not None:
            if model_id not in self.models and self.runs.run_dir(model_id) is None:
                raise KeyError(f"no training run {model_id!r} on this server")
            return {"checkpoints": self.runs.checkpoints(model_id,
                                                         self.runs.run_dir(model_id))}
        every = [c for m, run in self.runs.run_dirs().items()
                 for c in self.runs.checkpoints(m, run)]
        items, cursor = page(sorted(every, key=lambda c: c["time"], reverse=True), limit,
                             offset)
        return {"checkpoints": items, "cursor": cursor}

    def delete_checkpoint(self, model_id: str, checkpoint_id: str) -> None:
        self.runs.delete(model_id, self.runs.run_dir(model_id), checkpoint_id)

    def session_info(self, session_id: str) -> dict:
        with self.lock:
            if session_id not in self.sessions:
                raise KeyError(f"no session {session_id!r} on this server")
            models = list(self.sessions[session_id].models)
            samplers = self._samplers_of(session_id)
        return {"training_run_ids": models, "sampler_ids": samplers}

    def session_ids(self, limit: int | None, offset: int | None) -> dict:
        with self.lock:
            ids = list(reversed(self.sessions))  # (the newest first)
        return {"sessions": page(ids, limit, offset)[0]}


def save_state(directory: Path, state: dict, model_id: str) -> None:
    """A tenant's state through DCP (torch.distributed.checkpoint: the adapter, AdamW's
    moments) and its spec in meta.json, written last: a directory without it is incomplete."""
    import torch.distributed.checkpoint as dcp

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {"params": {str(i): p for i, p in enumerate(state["params"])}}
    if "optimizer" in state:
        tensors["optimizer"] = _str_keys(state["optimizer"])
    with warnings.catch_warnings():  # ("assuming the intent is to save in a single process")
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(tensors, checkpoint_id=str(directory), no_dist=True)
    (directory / "meta.json").write_text(json.dumps(
        {"model_id": model_id, "spec": state["spec"], "steps": state["steps"],
         "optimizer": "optimizer" in state, "params": len(state["params"]),
         "shapes": [list(p.shape) for p in state["params"]]}))


def load_state(directory: Path, with_optimizer: bool) -> dict:
    """What save_state wrote, as LoraTenants.load_state reads it."""
    import torch.distributed.checkpoint as dcp

    meta = json.loads((directory / "meta.json").read_text())
    if with_optimizer and not meta["optimizer"]:
        raise ValueError(f"the state at {directory} was saved without its optimizer: load "
                         "it without (load_state)")
    tensors = {"params": {str(i): torch.empty(s) for i, s in enumerate(meta["shapes"])}}
    if with_optimizer:
        tensors["optimizer"] = _optimizer_template(meta)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, checkpoint_id=str(directory), no_dist=True)
    out = {"spec": meta["spec"], "steps": meta["steps"],
           "params": [tensors["params"][str(i)] for i in range(meta["params"])]}
    if with_optimizer:
        out["optimizer"] = _int_keys(tensors["optimizer"])
    return out


def _str_keys(optimizer_state: dict) -> dict:
    """AdamW's state_dict with string keys (DCP flattens nested dicts by string keys)."""
    return {"state": {str(k): dict(v) for k, v in optimizer_state["state"].items()},
            "param_groups": optimizer_state["param_groups"]}


def _int_keys(saved: dict) -> dict:
    return {"state": {int(k): v for k, v in saved["state"].items()},
            "param_groups": saved["param_groups"]}


def _optimizer_template(meta: dict) -> dict:
    """Tensors of the right shapes for DCP to load AdamW's state into."""
    state = {str(i): {"step": torch.zeros(()), "exp_avg": torch.empty(s),
                      "exp_avg_sq": torch.empty(s)} for i, s in enumerate(meta["shapes"])}
    group = {"lr": 0.0, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
             "amsgrad": False, "foreach": None, "maximize": False, "capturable": False,
             "differentiable": False, "fused": None, "decoupled_weight_decay": True,
             "params": list(range(meta["params"]))}
    return {"state": state, "param_groups": [group]}


def spec_of(lora_config: dict | None, default_seed: int) -> LoraSpec:
    cfg = dict(lora_config or {})
    if "rank" not in cfg:
        raise ValueError("create_model needs lora_config.rank: this server trains LoRA "
                         "adapters only (full fine-tuning is not served)")
    seed = cfg.get("seed")
    return LoraSpec(rank=int(cfg["rank"]), seed=default_seed if seed is None else int(seed),
                    train_mlp=bool(cfg.get("train_mlp", True)),
                    train_attn=bool(cfg.get("train_attn", True)),
                    train_unembed=bool(cfg.get("train_unembed", True)))


def adam_of(body: dict) -> AdamStep:
    params = body.get("adam_params") or body.get("optim_params")
    if params is None:
        raise ValueError("optim_step needs adam_params (this server runs AdamW only)")
    if params.get("type", "adam") not in ("adam", "adamw"):
        raise ValueError(f"optimizer {params.get('type')!r}: this server runs AdamW only")
    known = {f for f in AdamStep.__dataclass_fields__}
    return AdamStep(**{k: float(v) for k, v in params.items() if k in known})
