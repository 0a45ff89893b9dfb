"""User reward functions in a worker process, so that one that hangs can be stopped.

A Python thread cannot be killed, and the generator process cannot be forked (it hosts the vLLM
engine, its threads and maybe CUDA), so user functions (`module:function`) run in one worker
process started with the `spawn` method. The generator sends it a whole batch in one message
and gets every result back in one message:

    parent -> worker:  (calls, samples, timeout_s)   calls = [(function k, sample i), ...]
    worker -> parent:  [("ok", value) | ("error", message) | ("timeout", None)] per call

Per-call timeouts, two layers:
  * soft: the worker arms SIGALRM for `timeout_s` around each call; the handler raises
    `CallTimeout` inside the user's code (ends sleeps, loops, most waits). The worker lives on.
  * hard: the worker publishes (index of the running call, its start time) in shared memory.
    If a call runs `timeout_s + KILL_GRACE_S` (the user's code swallowed the exception, or is
    stuck in C code that never returns to the interpreter) the parent kills the worker, counts
    a timeout for that call, starts a new worker and re-sends the batch minus that call
    (reward functions are pure, so re-running the others is safe).
A worker that dies (os._exit, a segfault) costs its running call an error and is restarted the
same way. So scoring a batch always ends, after at most ~calls x (timeout_s + grace) seconds.

The worker is a daemon: it is killed when the generator exits normally, and it exits by itself
(EOF on its pipe) when the generator is killed. It ignores SIGINT (the launcher handles Ctrl-C).
User functions therefore cannot start processes of their own with multiprocessing.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import signal
import time

KILL_GRACE_S = 2.0  # beyond timeout_s, before the worker is killed
START_TIMEOUT_S = 120.0  # spawning Python and importing the user's modules
_POLL_S = 0.05

# ("ok", value) | ("error", what happened, e.g. "raised KeyError: 3") | ("timeout", None)
Outcome = tuple[str, float | None | str]


class CallTimeout(BaseException):
    """Raised in the worker by SIGALRM. A BaseException, so `except Exception` in user code
    does not swallow it."""


def _on_alarm(signum, frame):
    raise CallTimeout()


def _call(fn, sample: tuple[str, str, str], timeout_s: float) -> Outcome:
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            value = fn(*sample)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except CallTimeout:
        return ("timeout", None)
    except BaseException as e:  # noqa: BLE001 - SystemExit from user code is an error too
        return ("error", f"raised {type(e).__name__}: {e}")
    try:
        value = float(value)
    except (TypeError, ValueError):
        return ("error", f"returned {value!r}, not a number")
    if not math.isfinite(value):
        return ("error", f"returned {value}, not a finite number")
    return ("ok", value)


def _worker_main(conn, names: list[str], progress) -> None:
    """The worker process: import the functions, then score batches until EOF or None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, _on_alarm)
    from llamarl.rewards.registry import resolve_user

    try:
        fns = [resolve_user(n) for n in names]
    except BaseException as e:  # noqa: BLE001 - an import may raise anything
        conn.send(("failed", str(e) if isinstance(e, ValueError) else
                   f"importing the reward functions raised {type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the generator is gone
            return
        if msg is None:
            return
        calls, samples, timeout_s = msg
        out = []
        for j, (k, i) in enumerate(calls):
            progress[0] = j
            progress[1] = time.monotonic()
            out.append(_call(fns[k], samples[i], timeout_s))
        progress[1] = 0.0  # idle
        try:
            conn.send(out)
        except (BrokenPipeError, OSError):
            return


def spawn_worker(ctx, target, name: str, args: tuple, what: str):
    """Start `target(conn, *args)` in a spawned daemon process and wait for its first
    message: ("ready", None), or ("failed", one-line reason) raised here as a ValueError.
    Returns (process, the parent's end of the pipe)."""
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, name=name, args=(child, *args), daemon=True)
    proc.start()
    child.close()
    if not parent.poll(START_TIMEOUT_S):
        proc.kill()
        raise RuntimeError(f"{what} did not start within {START_TIMEOUT_S:.0f} s")
    try:
        status, message = parent.recv()
    except EOFError:
        status, message = "failed", f"it exited with code {proc.exitcode}"
    if status != "ready":
        proc.kill()
        proc.join(10)
        raise ValueError(message)
    return proc, parent


class UserFunctionWorker:
    """Scores batches with user reward functions `names` in a spawned worker process."""

    def __init__(self, names: list[str], timeout_s: float):
        assert timeout_s > 0, timeout_s
        self.names = list(names)
        self.timeout_s = timeout_s
        self._ctx = mp.get_context("spawn")
        self._proc = None
        self._conn = None
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        self._progress = self._ctx.Array("d", 2, lock=False)  # [running call, its start time]
        self._proc, self._conn = spawn_worker(self._ctx, _worker_main, "llamarl-reward-worker",
                                              (self.names, self._progress),
                                              f"the reward worker for {self.names}")

    def _kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
        if self._proc is not None:
            self._proc.join(10)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(None)
                self._proc.join(1)
            except OSError:
                pass
        self._kill()

    def score(self, samples: list[tuple[str, str, str]]) -> list[list[Outcome]]:
        """Every function on every (completion, answer, prompt) sample: outcomes[k][i]."""
        pending = [(k, i) for k in range(len(self.names)) for i in range(len(samples))]
        done: dict[tuple[int, int], Outcome] = {}
        while pending:
            if self._proc is None:
                self.restarts += 1
                self._start()
            self._conn.send((pending, samples, self.timeout_s))
            results, failed_at, outcome = self._wait(len(pending))
            if results is not None:
                done.update(zip(pending, results))
                break
            # the worker was killed or died inside call `failed_at`: re-run the others
            done[pending[failed_at]] = outcome
            pending = pending[:failed_at] + pending[failed_at + 1:]
        return [[done[(k, i)] for i in range(len(samples))] for k in range(len(self.names))]

    def _wait(self, n_calls: int):
        """(results, None, None) when the batch comes back; (None, j, outcome) when call j
        overran the hard deadline (worker killed) or the worker died in it."""
        hard_s = self.timeout_s + KILL_GRACE_S
        while True:
            try:
                if self._conn.poll(_POLL_S):
                    results = self._conn.recv()
                    assert len(results) == n_calls, (len(results), n_calls)
                    return results, None, None
            except (EOFError, OSError):
                pass  # died: handled below
            started, j = self._progress[1], int(self._progress[0])
            if not self._proc.is_alive():
                code = self._proc.exitcode
                self._kill()
                return None, j, ("error", f"ended the reward worker process (exit code "
                                          f"{code})")
            if started and time.monotonic() - started > hard_s:
                self._kill()
                return None, j, ("timeout", None)
