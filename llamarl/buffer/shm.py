"""Same-host rollout transport: one shared-memory segment per batch, a descriptor in the store.

A `ShmChannel` joins one producer (a generator) to one consumer (a trainer rank). Bulk bytes go
through /dev/shm; the control path is the job's TCPStore (a queue of small JSON descriptors and
an `acked` counter), so a batch is never pickled or copied through a socket.

Ownership contract for a segment `llamarl_<run>_<channel>_<seq>`:
  1. The producer creates it, writes every column, then pushes its descriptor. It never writes
     to it again.
  2. The consumer pops the descriptor, maps the segment, copies the columns out, unlinks the
     segment, and only then bumps `acked`.
  3. Until it is acked, the producer also tracks the name; on any exit it unlinks what is
     unacked (a consumer that died never will). On a failed run every rank also sweeps
     /dev/shm for the run's prefix (`sweep_run`), which covers segments of a killed peer.
Backpressure: `put` waits while `capacity` batches are unacked; nothing is dropped.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from llamarl.buffer.record import RolloutBatch

SHM_DIR = Path("/dev/shm")
_POLL_S = 0.002


def segment_prefix(run_id: str) -> str:
    return f"llamarl_{run_id}_"


def sweep_run(run_id: str) -> int:
    """Unlink every segment of run `run_id` on this host; returns how many were removed."""
    n = 0
    for path in SHM_DIR.glob(segment_prefix(run_id) + "*"):
        try:
            path.unlink()
            n += 1
        except FileNotFoundError:
            pass
    return n


def _write_segment(name: str, batch: RolloutBatch) -> dict:
    cols = batch.columns()
    layout, offset = {}, 0
    for key, t in cols.items():
        nbytes = t.numel() * t.element_size()
        layout[key] = [str(t.dtype).removeprefix("torch."), t.numel(), offset]
        offset += (nbytes + 63) // 64 * 64  # 64-byte aligned columns
    size = max(offset, 1)
    fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as mm:
            for key, t in cols.items():
                _, numel, off = layout[key]
                if numel:
                    dst = torch.frombuffer(mm, dtype=t.dtype, count=numel, offset=off)
                    dst.copy_(t)
                    del dst
    finally:
        os.close(fd)
    return {"name": name, "size": size, "layout": layout, "info": batch.info}


def _read_segment(desc: dict) -> RolloutBatch:
    path = SHM_DIR / desc["name"]
    fd = os.open(path, os.O_RDONLY)
    try:
        with mmap.mmap(fd, desc["size"], prot=mmap.PROT_READ) as mm:
            buf = memoryview(mm)
            cols = {}
            for key, (dtype, numel, off) in desc["layout"].items():
                dt = getattr(torch, dtype)
                if numel:
                    nbytes = numel * torch.empty((), dtype=dt).element_size()
                    cols[key] = torch.frombuffer(bytearray(buf[off:off + nbytes]), dtype=dt)
                else:
                    cols[key] = torch.empty(0, dtype=dt)
            buf.release()
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return RolloutBatch(**cols, info=desc["info"])


class ShmChannel:
    """One direction, one producer, one consumer. `store` is the job's (prefixed) store."""

    def __init__(self, store, run_id: str, channel: str, capacity: int,
                 check_alive: Callable[[], None] = lambda: None):
        self.store = store
        self.channel = channel
        self.prefix = f"{segment_prefix(run_id)}{channel}_"
        self.capacity = capacity
        self.check_alive = check_alive  # raises if a peer is dead, so waits never hang
        self.queue_key = f"buf/{channel}/queue"
        self.acked_key = f"buf/{channel}/acked"
        self._seq = 0
        self._unacked: list[str] = []
        self.wait_s = 0.0  # time spent blocked (backpressure or empty queue)

    # -- producer -------------------------------------------------------------------------
    def put(self, batch: RolloutBatch) -> None:
        t0 = time.perf_counter()
        while self._seq - self._acked() >= self.capacity:  # backpressure: wait, never drop
            self.check_alive()
            time.sleep(_POLL_S)
        self.wait_s += time.perf_counter() - t0
        self._forget_acked()
        name = f"{self.prefix}{self._seq}"
        self._unacked.append(name)
        desc = _write_segment(name, batch)
        self._seq += 1
        self.store.queue_push(self.queue_key, json.dumps(desc))

    def _acked(self) -> int:
        return self.store.add(self.acked_key, 0)

    def _forget_acked(self) -> None:
        acked = self._acked()
        done = len(self._unacked) - (self._seq - acked)
        del self._unacked[:max(done, 0)]

    # -- consumer -------------------------------------------------------------------------
    def get(self) -> RolloutBatch:
        t0 = time.perf_counter()
        while self.store.queue_len(self.queue_key) == 0:
            self.check_alive()
            time.sleep(_POLL_S)
        self.wait_s += time.perf_counter() - t0
        desc = json.loads(self.store.queue_pop(self.queue_key, False))
        batch = _read_segment(desc)
        self.store.add(self.acked_key, 1)
        return batch

    # -- any exit path --------------------------------------------------------------------
    def close(self, drain_timeout_s: float = 0.0) -> None:
        """Producer exit. On a normal exit wait up to `drain_timeout_s` for the consumer to take
        what is in flight; then (and on failure paths, at once) unlink what was never consumed."""
        deadline = time.monotonic() + drain_timeout_s
        try:
            while self._unacked and self._seq - self._acked() > 0:
                if time.monotonic() > deadline:
                    break
                self.check_alive()
                time.sleep(_POLL_S)
        except Exception:  # the store or a peer is gone: nothing will consume them
            pass
        for name in self._unacked:
            (SHM_DIR / name).unlink(missing_ok=True)
        self._unacked.clear()
