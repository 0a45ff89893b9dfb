"""Under torchrun, an engine rank that the job can lose runs as a child of a small supervisor.

torchrun's agent stops every rank of the job the moment one of its workers exits non-zero,
before llamarl can drop a lost engine and go on without it (sync.engine_loss=continue,
runtime/roster.py). So under torchrun a generator rank of a job that survives engine losses is
two processes: the supervisor (this module; the process torchrun started and watches, light:
no vLLM, no model) and the rank itself, its child, which runs `python -m llamarl.launch` as
before (`LLAMARL_SUPERVISED=1`: it does not supervise itself).

    child exits 0                      -> the supervisor exits 0
    child dies (kill -9, OOM, a crash)
      and the job declares it lost     -> the supervisor says so in one line and starts a
                                          replacement as its next child (`--join RUN_DIR`,
                                          sync.engine_restarts times per engine; not once the
                                          trainers are done; an engine of tp > 1 is lost
                                          and replaced whole, by its tp rank 0's
                                          supervisor, whose child may have left with it
                                          (exit 0, `left/<rank>`)); after the last, it exits
                                          0: to torchrun this worker has finished, the
                                          others go on
      and the job cannot go on         -> the supervisor exits with the child's code: the
                                          job stops (and restarts under --max-restarts)
    a replacement fails otherwise      -> (it left, exit 0: replaced again as above, within
                                          sync.engine_restarts) exits 0: the job goes on
                                          without this engine
    torchrun stops the job (SIGTERM)   -> passed on to the child, whose code is returned

The other ranks' watchdogs watch the child (its pid is the rank's, `proc/<rank>`). The child
dies with its supervisor (PR_SET_PDEATHSIG), so no rank outlives a supervisor that is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from llamarl.config import Config
from llamarl.launch.join import ENGINE_ENV, die_with_parent
from llamarl.runtime.dist_env import DistEnv
from llamarl.runtime.layout import Layout

SUPERVISED = "LLAMARL_SUPERVISED"


def wants_supervisor(cfg: Config, layout: Layout, env: DistEnv) -> bool:
    """A generator rank under torchrun whose loss the job survives (parallel/plan.py:
    survives_engine_loss), not already the supervised child."""
    if env.launcher != "torchrun" or os.environ.get(SUPERVISED):
        return False
    if layout.role_of(env.rank).role != "generator" or layout.engines < 2:
        return False  # (the cheap part of survives_engine_loss, before importing torch)
    import torch

    from llamarl.parallel.plan import comm_plan

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    return comm_plan(cfg, layout, backend).survives_engine_loss


def supervise(argv: list[str], cfg: Config, layout: Layout, env: DistEnv) -> int:
    """Run this rank as a child process; return the exit code torchrun should see."""
    role = layout.role_of(env.rank)
    name = f"rank {env.rank} ({role.name})"
    cmd = [sys.executable, "-m", "llamarl.launch", *argv]
    # an engine of tp > 1 is lost whole and replaced whole by one --join (launch/join.py,
    # which starts its other tp ranks): its tp rank 0's supervisor starts it
    restarts_left = cfg.sync.engine_restarts if role.is_engine_leader else 0
    replacing = False
    stopping: list[int] = []
    child: subprocess.Popen | None = None

    def pass_on(signum, _frame) -> None:
        stopping.append(signum)
        if child is not None:
            child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, pass_on)
    while True:
        # its own process group: torchrun signals the worker's group (killpg) and a terminal
        # its foreground group, and the child must get each signal once, passed on from here
        child = subprocess.Popen(cmd, env={**os.environ, SUPERVISED: "1"},
                                 preexec_fn=die_with_parent, start_new_session=True)
        code = child.wait()
        if stopping:
            return code
        store = None
        if code == 0:  # done, or left the job with its lost engine (a tp > 1 engine's rank
            # whose mate died; a replacement that failed before it was back): replace that
            if not restarts_left:
                return 0
            store = _job_store(env)
            if store is None or not _left(store, env.rank):
                return 0
            how = "it left the job with its lost engine"
        else:
            how = "its process died (" + (f"signal {-code}" if code < 0 else
                                          f"exit code {code}") + ")"
            store = _job_store(env)
        if store is None or not _declared_lost(store, env.rank, cfg.sync.dead_peer_s + 15.0):
            if replacing:  # a replacement that failed must not end a job that went on
                print(f"llamarl: {name}: its replacement failed ({how}); the job goes on "
                      "without this engine", file=sys.stderr, flush=True)
                return 0
            return code if code > 0 else 128 - code
        run = json.loads(store.get("run"))["dir"]
        if restarts_left == 0 or store.check(["trainer/final_version"]):
            if (layout.tp > 1 and not role.is_engine_leader and cfg.sync.engine_restarts
                    and not store.check(["trainer/final_version"])):
                replace = (f"the supervisor of generator {role.index}'s tp rank 0 starts its "
                           "replacement")
            else:
                replace = f"replace the engine: python -m llamarl.launch --join {run}" + (
                    f", which starts its {layout.tp} ranks" if layout.tp > 1 else "")
            print(f"llamarl: {name}: {how} and the job goes on without it; this worker ends "
                  f"well so that torchrun keeps the others ({replace})",
                  file=sys.stderr, flush=True)
            return 0
        restarts_left -= 1
        what = "a replacement" if layout.tp == 1 else f"a replacement of its {layout.tp} ranks"
        print(f"llamarl: {name}: {how}; the job goes on without it while {what} starts "
              f"(sync.engine_restarts: {restarts_left} left)", file=sys.stderr, flush=True)
        cmd, replacing = [sys.executable, "-m", "llamarl.launch", "--join", run], True
        os.environ[ENGINE_ENV] = str(role.index)  # (its own engine, on its own node)


def _left(store, rank: int) -> bool:
    """Whether `rank` left the job with its lost engine (watchdog.leave marks `left/<rank>`)."""
    try:
        return store.check([f"left/{rank}"])
    except Exception:  # noqa: BLE001 - the store is gone: the job is over
        return False


def _job_store(env: DistEnv):
    """The job's store (prefixed as the ranks use it), or None when it is gone."""
    from torch.distributed import PrefixStore

    from llamarl.runtime.job_store import connect_store, job_prefix

    try:
        return PrefixStore(job_prefix(env.restart),
                           connect_store(env.master_addr, env.master_port, 10.0))
    except Exception:  # noqa: BLE001 - the store is gone: the job is over, not going on
        return None


def _declared_lost(store, rank: int, within_s: float) -> bool:
    """Whether the job marks `rank` lost (`done/<rank>` = "lost", set by the watchdog that
    finds it dead) within `within_s`."""
    from llamarl.runtime.job_store import peek

    deadline = time.monotonic() + within_s
    key = f"done/{rank}"
    try:
        while time.monotonic() < deadline:
            if peek(store, key) == b"lost":  # (never waits: a replacement deletes it)
                return True
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 - the store is gone: the job is over, not going on
        return False
    return False
