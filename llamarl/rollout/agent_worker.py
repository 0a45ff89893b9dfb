"""Agents in worker processes: the user's agent function runs one episode per call.

An agent (rollout.agent, "module:function") is user code: it may hang, raise, crash its
interpreter or return garbage. It runs in the environment workers' machinery
(rollout/env_worker.py: `rollout.workers` spawned processes per engine, each running
episodes on `rollout.threads_per_worker` threads, a deadline per call, a dead or stuck
worker killed and restarted), with one call per episode:

    parent -> worker:  (call id, episode id, "run", (row, api key))
    worker -> parent:  (call id, "ok", (reward, metrics)) | (call id, "error", "run raised ...")

The worker builds the episode's client (openai.OpenAI, or openai.AsyncOpenAI for an
`async def` agent, which then runs in its own event loop on the call's thread) with the
gateway's base_url and the episode's key, calls `agent(client, row)`, closes the client,
and checks the result: a finite number, or {"reward": number, "metrics": {name: number}}.

A call past rollout.agent_timeout_s fails its episode (the thread cannot be killed and may
run on: its key is revoked, so its later model calls are refused with a 403). A worker
that dies (os._exit, a segfault) fails every episode running in it: an agent episode is one
call, so there is nothing to replay. Errors never stop the run (rollout/agent_source.py).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import signal
import threading
import time

from llamarl.registry.envs import BUILTIN_AGENTS
from llamarl.rewards.sandbox import spawn_worker
from llamarl.rollout.env_worker import EnvPool, serve_calls


def resolve_agent(name: str):
    from llamarl.imports import import_path

    fn = import_path(BUILTIN_AGENTS.get(name, name), f"rollout.agent {name!r}")
    if not callable(fn):
        raise ValueError(f"rollout.agent {name!r} is not a function: write "
                         "def agent(client, row) -> float")
    return fn


class BadResult(ValueError):
    """What an agent returned is not a reward."""


def agent_result(value) -> tuple[float, dict]:
    """(reward, metrics) from what an agent returned; BadResult for anything else."""
    metrics = {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise BadResult(f"returned a dict without 'reward' ({sorted(value)})")
        metrics = value.get("metrics") or {}
        if not isinstance(metrics, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                for k, v in metrics.items()):
            raise BadResult(f"returned metrics {metrics!r}: use {{name: number}}")
        value = value["reward"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadResult(f"returned {value!r}, not a number (return the reward, or "
                         "{'reward': r, 'metrics': {...}})")
    if not math.isfinite(value):
        raise BadResult(f"returned {value}, not a finite number")
    return float(value), {k: float(v) for k, v in metrics.items()}


_HTTP = None  # the worker's HTTP connection pool, shared by its sync episodes
_HTTP_LOCK = threading.Lock()


def _http(threads: int):
    """One httpx.Client per worker (thread-safe, keep-alive): a client per episode cost a
    TLS context each (loading the CA bundle, milliseconds of CPU) and a new connection.
    trust_env=False: the gateway is reached directly, never through an HTTP(S)_PROXY."""
    global _HTTP
    import httpx

    with _HTTP_LOCK:
        if _HTTP is None:
            _HTTP = httpx.Client(trust_env=False, verify=False, limits=httpx.Limits(
                max_connections=threads, max_keepalive_connections=threads))
        return _HTTP


def run_episode(fn, base_url: str, key: str, row: dict, timeout_s: float, threads: int = 1):
    """One episode: `fn(client, row)` with a client for the gateway (the gateway is plain
    HTTP, hence verify=False: no CA bundle to load)."""
    import httpx
    import openai

    if inspect.iscoroutinefunction(fn):  # its own event loop, so its own connections
        async def go():
            async with openai.AsyncOpenAI(
                    base_url=base_url, api_key=key, max_retries=0, timeout=timeout_s,
                    http_client=httpx.AsyncClient(trust_env=False, verify=False)) as client:
                return await fn(client, row)
        return asyncio.run(go())
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=timeout_s,
                           http_client=_http(threads))
    return fn(client, row)  # (not closed: that would close the shared pool)


def _worker_main(conn, agent: str, base_url: str, threads: int, timeout_s: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        fn = resolve_agent(agent)
        import openai  # noqa: F401 - fail here, not in every episode
    except ModuleNotFoundError as e:
        extra = ": agents need the `agents` extra: pip install -e '.[agents]' (make installs " \
            "it)" if e.name in ("openai", "agents") else ""
        conn.send(("failed", f"importing rollout.agent {agent!r} raised "
                   f"ModuleNotFoundError: {e}{extra}"))
        return
    except BaseException as e:  # noqa: BLE001 - an import may raise anything
        conn.send(("failed", str(e) if isinstance(e, ValueError) else
                   f"importing rollout.agent {agent!r} raised {type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    lock = threading.Lock()

    def work(call_id, episode, method, arg):
        row, key = arg
        try:
            reply = (call_id, "ok", agent_result(run_episode(fn, base_url, key, row,
                                                             timeout_s, threads)))
        except BaseException as e:  # noqa: BLE001 - SystemExit from user code is an error too
            reply = (call_id, "error", f"the agent {e}" if isinstance(e, BadResult)
                     else f"the agent raised {type(e).__name__}: {e}")
        with lock:
            try:
                conn.send(reply)
            except (BrokenPipeError, OSError):
                pass

    serve_calls(conn, work, threads, "llamarl-agent")


class AgentPool(EnvPool):
    """`workers` processes running episodes of agent `agent` against `base_url`; poll()
    reports (call id, episode, ("ok", (reward, metrics)) | ("error", why) | ("timeout",
    None))."""

    def __init__(self, agent: str, base_url: str, workers: int, threads: int,
                 timeout_s: float):
        self.base_url = base_url
        super().__init__(agent, "", workers, threads, timeout_s)

    def _start(self, w: int) -> None:
        proc, parent = spawn_worker(self._ctx, _worker_main, f"llamarl-agent-worker-{w}",
                                    (self.env_name, self.base_url, self.threads,
                                     self.timeout_s),
                                    f"the agent worker for {self.env_name!r}")
        self._procs[w], self._conns[w] = proc, parent
        self._last_reply[w] = time.monotonic()

    def run(self, episode: int, row: dict, key: str) -> int:
        """Start an episode; returns the call id poll() reports."""
        return self.call(episode, "run", (row, key))
