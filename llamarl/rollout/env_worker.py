"""Environments in worker processes, with concurrent calls and deadlines.

Environment and tool code is user code: it may hang, crash the interpreter or leak. It runs in
`rollout.workers` spawned processes (the generator process hosts vLLM and cannot fork); each
hosts the live environments of the episodes assigned to it (episode id % workers) and runs
calls on a thread pool of `rollout.threads_per_worker`, so episodes whose tools wait (I/O,
sleeps, subprocesses) overlap. Calls are asynchronous: the episode runner submits, generates
meanwhile, and polls.

    parent -> worker:  (call id, episode id, method, argument)
                        method: "open" (row -> first prompt), "turn" (text -> observation or
                        None, counts), "reward" (answer -> float; the environment is dropped)
    worker -> parent:  (call id, "ok", value) | (call id, "error", "raised KeyError: 3")

Deadlines (rollout.timeout_s per call): a call without a reply by then is a "timeout" for its
episode (a late reply is ignored; a thread cannot be killed, so it may run on). A worker that
has not replied to anything for timeout_s + KILL_GRACE_S while a call of it is overdue (its
interpreter is stuck), or that died (a tool called os._exit, a segfault), is killed and
restarted. Nothing waits forever.

What a worker's death costs: the episodes that had a call running in it end with an error
(any of those calls may be what killed it, and running it again may kill the new worker:
up to rollout.threads_per_worker of them, usually one). Every other live episode of that
worker is restored in the new one: the pool keeps each episode's calls (its row, then the
text of each turn) and replays them there ("replay", run before any later call of the
worker), so it goes on as if nothing happened, provided its environment is deterministic
in those calls (a tool with outside side effects runs them again). Text an environment
returns that is not valid Unicode (a lone surrogate, which no tokenizer can encode) fails
its own call.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from llamarl.rewards.sandbox import KILL_GRACE_S, spawn_worker

Outcome = tuple[str, object]  # ("ok", value) | ("error", message) | ("timeout", None)


def _resolve_env(name: str):
    from llamarl.imports import import_path
    from llamarl.registry.envs import BUILTIN_ENVS
    from llamarl.rollout.environment import Environment

    cls = import_path(BUILTIN_ENVS.get(name, name), f"rollout.env {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"rollout.env {name!r} is not a subclass of "
                         "llamarl.rollout.Environment")
    return cls


def _check_text(value, what: str) -> None:
    """ValueError where `value` (a str, or chat messages) holds text that is not valid
    Unicode: a lone surrogate such as "\\ud800" passes through Python but no tokenizer can
    encode it (the generator's tokenizer would raise a TypeError for the whole run)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{what} returned text that is not valid Unicode "
                             f"({value[e.start:e.end]!r} at position {e.start}: a lone "
                             "surrogate); return str of valid characters") from None
    elif isinstance(value, list):
        for message in value:
            if isinstance(message, dict):
                for v in message.values():
                    _check_text(v, what)


def _run(envs: dict, cls, tool_format: str, episode: int, method: str, arg) -> object:
    if method == "open":
        env = cls(arg)
        envs[episode] = env
        prompt = env.prompt()
        if not isinstance(prompt, (str, list)):
            raise TypeError(f"prompt() returned {type(prompt).__name__}, not str or messages")
        _check_text(prompt, "prompt()")
        return prompt
    if method == "replay":  # rebuild a live episode after its worker was restarted
        row, turns = arg
        env = cls(row)
        env.prompt()
        for text in turns:
            env.turn(text, tool_format)
        envs[episode] = env
        return None
    if method == "close":  # an episode stopped before its end (generator/continuous.py)
        envs.pop(episode, None)
        return None
    env = envs.get(episode)
    if env is None:
        raise RuntimeError("its environment is gone (its worker was restarted after a "
                           "crash or a stuck call)")
    if method == "turn":
        out = env.turn(arg, tool_format)
        if isinstance(out, tuple) and out:
            _check_text(out[0], "turn()")
        return out
    if method == "reward":
        del envs[episode]
        value = float(env.reward(arg))
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"reward() returned {value}, not a finite number")
        return value
    raise AssertionError(method)


def _worker_main(conn, env_name: str, tool_format: str, threads: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        cls = _resolve_env(env_name)
    except BaseException as e:  # noqa: BLE001 - an import may raise anything
        conn.send(("failed", str(e) if isinstance(e, ValueError) else
                   f"importing rollout.env {env_name!r} raised {type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    envs: dict = {}
    lock = threading.Lock()

    def work(call_id, episode, method, arg):
        try:
            reply = (call_id, "ok", _run(envs, cls, tool_format, episode, method, arg))
        except BaseException as e:  # noqa: BLE001 - SystemExit from user code is an error too
            envs.pop(episode, None)  # a failed call ends its episode, under either on_error
            reply = (call_id, "error", f"{method} raised {type(e).__name__}: {e}")
        with lock:
            try:
                conn.send(reply)
            except (BrokenPipeError, OSError):
                pass

    # a replay runs before any later call, which may be of its episode
    serve_calls(conn, work, threads, "llamarl-env", inline=lambda msg: msg[2] == "replay")


def serve_calls(conn, work, threads: int, name: str, inline=lambda msg: False) -> None:
    """A worker's loop: run each call the parent sends, `work(*msg)`, on a pool of `threads`
    threads (`inline` ones on this thread, before the next is read) until the parent says
    stop (None) or is gone."""
    with ThreadPoolExecutor(threads, thread_name_prefix=name) as pool:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if msg is None:
                return
            if inline(msg):
                work(*msg)
                continue
            pool.submit(work, *msg)


@dataclass
class _Call:
    episode: int
    worker: int
    started: float


class EnvPool:
    """`workers` processes hosting environments `env_name`; see the module docstring."""

    def __init__(self, env_name: str, tool_format: str, workers: int, threads: int,
                 timeout_s: float):
        self.env_name, self.tool_format = env_name, tool_format
        self.threads, self.timeout_s = threads, timeout_s
        self._ctx = mp.get_context("spawn")
        self._procs: list = [None] * workers
        self._conns: list = [None] * workers
        self._last_reply = [0.0] * workers
        self._pending: dict[int, _Call] = {}
        self._next_id = 0
        self.restarts = 0
        # the calls of each live episode, to replay in a restarted worker: (row, turn texts)
        self._history: dict[int, tuple[object, list[str]]] = {}
        self._internal: set[int] = set()  # replay calls: their outcomes are not reported
        self.replayed = 0  # episodes restored after a worker's death
        for w in range(workers):
            self._start(w)

    def _start(self, w: int) -> None:
        proc, parent = spawn_worker(self._ctx, _worker_main, f"llamarl-env-worker-{w}",
                                    (self.env_name, self.tool_format, self.threads),
                                    f"the environment worker for {self.env_name!r}")
        self._procs[w], self._conns[w] = proc, parent
        self._last_reply[w] = time.monotonic()

    def close(self) -> None:
        for w, (proc, conn) in enumerate(zip(self._procs, self._conns)):
            if proc is None:
                continue
            try:
                conn.send(None)
                proc.join(1)
            except OSError:
                pass
            if proc.is_alive():
                proc.kill()
            proc.join(5)
            conn.close()
            self._procs[w] = self._conns[w] = None

    def call(self, episode: int, method: str, arg) -> int:
        """Submit `method(arg)` for `episode`; returns the call id that poll() reports."""
        w = episode % len(self._procs)
        call_id, self._next_id = self._next_id, self._next_id + 1
        if method == "open":
            self._history[episode] = (arg, [])
        elif method == "turn" and episode in self._history:
            self._history[episode][1].append(arg)
        elif method in ("reward", "close"):
            self._history.pop(episode, None)
        if not self._pending or all(c.worker != w for c in self._pending.values()):
            self._last_reply[w] = time.monotonic()  # idle until now: not stuck
        self._pending[call_id] = _Call(episode, w, time.monotonic())
        try:
            self._conns[w].send((call_id, episode, method, arg))
        except (BrokenPipeError, OSError):
            pass  # the worker died: poll() finds it and fails the call
        return call_id

    @property
    def pending(self) -> int:
        return len(self._pending)

    def poll(self, wait_s: float = 0.0) -> list[tuple[int, int, Outcome]]:
        """(call id, episode, outcome) of the calls that ended, waiting up to `wait_s` for the
        first one."""
        out: list[tuple[int, int, Outcome]] = []
        conns = [c for c in self._conns if c is not None]
        if wait_s > 0 and self._pending:
            mp.connection.wait(conns, timeout=wait_s)
        for w, conn in enumerate(self._conns):
            while conn is not None:
                try:
                    if not conn.poll():
                        break
                    call_id, kind, value = conn.recv()
                except (EOFError, OSError):
                    break
                self._last_reply[w] = time.monotonic()
                call = self._pending.pop(call_id, None)
                if kind != "ok" and call is not None:  # the worker dropped its environment
                    self._history.pop(call.episode, None)
                if call_id in self._internal:  # a replay: a failure shows at its next call
                    self._internal.discard(call_id)
                elif call is not None:  # None: it had timed out already
                    out.append((call_id, call.episode, (kind, value)))
        out += self._expire()
        return out

    def _expire(self) -> list[tuple[int, int, Outcome]]:
        now, out, dead = time.monotonic(), [], set()
        for w, proc in enumerate(self._procs):
            if not proc.is_alive():
                dead.add(w)
        for call_id, call in list(self._pending.items()):
            if call.worker in dead:
                continue
            if now - call.started > self.timeout_s:
                del self._pending[call_id]
                self._history.pop(call.episode, None)  # (it ends its episode)
                if call_id not in self._internal:
                    out.append((call_id, call.episode, ("timeout", None)))
                if now - self._last_reply[call.worker] > self.timeout_s + KILL_GRACE_S:
                    dead.add(call.worker)  # stuck interpreter: nothing comes back from it
        for w in dead:
            code = self._procs[w].exitcode
            for call_id, call in list(self._pending.items()):
                if call.worker == w:  # running when it died: any may be the cause
                    del self._pending[call_id]
                    self._history.pop(call.episode, None)
                    if call_id in self._internal:
                        self._internal.discard(call_id)
                        continue
                    out.append((call_id, call.episode,
                                ("error", f"the environment worker died (exit code {code}) "
                                 "during this call" if code is not None else
                                 "the environment worker was stuck and was restarted")))
            if self._procs[w].is_alive():
                self._procs[w].kill()
            self._procs[w].join(5)
            self._conns[w].close()
            self.restarts += 1
            self._start(w)
            # the worker's other live episodes: rebuilt in the new one from their calls
            for episode, (row, turns) in list(self._history.items()):
                if episode % len(self._procs) == w:
                    self._internal.add(self.call(episode, "replay", (row, list(turns))))
                    self.replayed += 1
        return out
