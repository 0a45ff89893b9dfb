"""Reaching the job's TCPStore, and making sure it is this job's.

Under torchrun the agent hosts the store and every rank is its client (one store per torchrun,
nothing to check). Under Slurm (srun, no torchrun) global rank 0 hosts it at
MASTER_ADDR:MASTER_PORT and the others connect there, so a port another job already holds is
a trap: rank 0 cannot bind, and the other ranks would join the other job's store (and its
run). So:

  * rank 0: binding fails -> one line naming MASTER_PORT; on success it publishes the job's
    identity (SLURM_JOB_ID.SLURM_STEP_ID) under `llamarl/job`;
  * every other rank: waits until something listens at the address, connects with a bounded
    handshake (a listener that is not a TCPStore accepts and never answers: TCPStore's own
    timeout does not cover that, so the connect runs in a thread that is given up on), then
    compares the published identity with its own. A mismatch or a foreign listener is one
    line naming MASTER_PORT, within seconds.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from llamarl.errors import first_line
from llamarl.runtime.dist_env import DistEnv


def connect_store(host: str, port: int, timeout_s: float,
                  is_master: bool = False, world_size: int | None = None) -> dist.TCPStore:
    """A TCPStore handle: the server when `is_master`, else a client of host:port."""
    return dist.TCPStore(host, port, world_size, is_master,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)

JOB_KEY = "llamarl/job"
HANDSHAKE_S = 15.0  # a TCPStore answers its client's handshake at once


class StoreError(RuntimeError):
    """This rank cannot reach its own job's store; the message is the one line to print."""


def job_prefix(restart: int | str) -> str:
    """The prefix of every key of one incarnation of the job (torchrun restart `restart`):
    the ranks, a supervisor and a --join replacement must all read the same keys."""
    return f"llamarl/{restart}"


def job_identity(environ=None) -> str:
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID", "")
    return f"{job}.{env.get('SLURM_STEP_ID', '0')}" if job else ""


def open_job_store(env: DistEnv, timeout_s: float) -> dist.TCPStore:
    where = f"{env.master_addr}:{env.master_port} (MASTER_ADDR:MASTER_PORT)"
    if env.agent_store:
        return connect_store(env.master_addr, env.master_port, timeout_s)
    if env.rank == 0:
        try:
            store = connect_store(env.master_addr, env.master_port, timeout_s, is_master=True,
                                  world_size=env.world_size)
        except Exception as e:
            raise StoreError(f"cannot host the job's store at {where}: {first_line(e, 160)}; "
                             "another process holds the port: set MASTER_PORT to a free port"
                             ) from None
        store.set(JOB_KEY, job_identity())
        return store
    _wait_for_listener(env.master_addr, env.master_port, timeout_s, where)
    probe = _bounded_connect(env.master_addr, env.master_port, where)
    try:
        probe.wait([JOB_KEY], timedelta(seconds=timeout_s))
        theirs = probe.get(JOB_KEY).decode()
    except Exception as e:
        raise StoreError(f"the store at {where} never said which job it belongs to "
                         f"({type(e).__name__}): set MASTER_PORT to a free port") from None
    mine = job_identity()
    if theirs != mine:
        raise StoreError(f"the store at {where} belongs to job {theirs or '(none)'}, not to "
                         f"this job ({mine or '(none)'}): another job holds the port; set "
                         "MASTER_PORT to a free port")
    return connect_store(env.master_addr, env.master_port, timeout_s)


def _wait_for_listener(host: str, port: int, timeout_s: float, where: str) -> None:
    """Until something accepts connections at host:port (rank 0 may start later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=2.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise StoreError(f"nothing listens at {where} after {timeout_s:.0f} s: is "
                                 "rank 0 running, and MASTER_ADDR right?") from None
            time.sleep(0.2)


def _bounded_connect(host: str, port: int, where: str) -> dist.TCPStore:
    box: dict = {}

    def connect():
        try:
            box["store"] = connect_store(host, port, HANDSHAKE_S)
        except Exception as e:  # noqa: BLE001 - reported below
            box["error"] = e

    thread = threading.Thread(target=connect, daemon=True, name="llamarl-store-handshake")
    thread.start()
    thread.join(HANDSHAKE_S + 5)
    if "store" in box:
        return box["store"]
    why = f"{type(box['error']).__name__}" if "error" in box else "no handshake"
    raise StoreError(f"{where} answers but is not a llamarl job store ({why}): another "
                     "program holds the port; set MASTER_PORT to a free port")


_ABSENT = "\x00llamarl-absent"


def peek(store, key: str) -> bytes | None:
    """The value of `key`, or None if it is not set, in one store call that never waits (a
    check then a get would wait for a key deleted in between: a replacement deletes its
    `done/<rank>`). TCPStore's compare_set with an expected value that is never stored sets
    nothing and returns that value for a missing key, else the key's value."""
    value = store.compare_set(key, _ABSENT, _ABSENT)
    return None if value == _ABSENT.encode() else value
