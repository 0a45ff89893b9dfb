"""Same-host rollout transport: one shared-memory segment per batch (see channel.py).

Ownership contract for a segment `llamarl_<run>_<channel>_<seq>`:
  1. The producer creates it under a temporary name (`.tmp`), writes every column, renames it
     to its number and pushes its descriptor. It never writes to it again. (So a numbered
     segment is a published batch, but for the instant between the rename and the push.)
  2. The consumer pops the descriptor, maps the segment, copies the columns out, bumps
     `acked`, and then unlinks the segment. (A segment that exists at the channel's next
     number, `acked` + queued, is one a consumer reads now: `Channel.adopt` waits for `acked`
     to move.)
  3. Until it is acked, the producer also tracks the name; on any exit it unlinks what is
     unacked (a consumer that died never will). On a failed run every rank also sweeps
     /dev/shm for the run's prefix (`sweep_run`), which covers segments of a killed peer.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from llamarl.buffer import pack
from llamarl.buffer.channel import Channel
from llamarl.buffer.record import RolloutBatch

SHM_DIR = Path("/dev/shm")


def segment_prefix(run_id: str) -> str:
    return f"llamarl_{run_id}_"


# ZMQ refuses an ipc:// socket path over 107 characters; vLLM names a socket DIR/<uuid4>
IPC_DIR_MAX_LEN = 107 - 37


def ipc_dir(prefix: str) -> Path | None:
    """The directory of a tp > 1 engine's ZMQ socket files (vLLM's VLLM_RPC_BASE_PATH, which
    would leave them in the temporary directory), named after its shared-memory prefix so
    that sweep_run removes it with the run's segments; None where that path would be too
    long for a socket (a long TMPDIR): vLLM's default then."""
    path = Path(tempfile.gettempdir()) / f"{prefix}ipc"
    return path if len(str(path)) <= IPC_DIR_MAX_LEN else None


def sweep_run(run_id: str) -> int:
    """Unlink every segment of run `run_id` on this host, and remove its engines' socket
    directories (ipc_dir); returns how many segments were removed."""
    n = 0
    for path in SHM_DIR.glob(segment_prefix(run_id) + "*"):
        if path.is_dir():  # (an ipc_dir, where the temporary directory is /dev/shm)
            continue
        try:
            path.unlink()
            n += 1
        except FileNotFoundError:
            pass
    for path in Path(tempfile.gettempdir()).glob(segment_prefix(run_id) + "*ipc"):
        shutil.rmtree(path, ignore_errors=True)
    return n


class ShmChannel(Channel):
    transport = "shared memory"
    wakes_consumer = True

    def __init__(self, store, run_id: str, channel: str, capacity: int,
                 check_alive: Callable[[], None] = lambda: None,
                 make_store: Callable[[], object] | None = None):
        super().__init__(store, channel, capacity, check_alive, make_store)
        self.prefix = f"{segment_prefix(run_id)}{channel}_"

    def _send(self, batch: RolloutBatch, seq: int) -> tuple[Path, dict]:
        path = self._handle(seq)
        layout, size = pack.plan(batch)
        fd = os.open(_writing(path), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            with mmap.mmap(fd, size) as mm:
                view = torch.frombuffer(mm, dtype=torch.uint8, count=size)
                pack.write(batch, layout, view)  # columns straight into shared memory
                del view
        finally:
            os.close(fd)
        os.rename(_writing(path), path)
        return path, {"name": path.name, "size": size, "layout": layout, "info": batch.info}

    def _receive(self, desc: dict) -> RolloutBatch:
        fd = os.open(SHM_DIR / desc["name"], os.O_RDONLY)
        try:
            with mmap.mmap(fd, desc["size"], prot=mmap.PROT_READ) as mm:
                # the one copy out: the batch's columns are views of this buffer
                buf = torch.frombuffer(bytearray(mm), dtype=torch.uint8)
        finally:
            os.close(fd)
        return pack.unpack(desc["layout"], buf, desc["info"])

    def _consumed(self, desc: dict) -> None:  # (after the ack: see the module docstring)
        (SHM_DIR / desc["name"]).unlink(missing_ok=True)

    payload_outlives_producer = True  # a segment stays in /dev/shm when its writer dies

    def _handle(self, seq: int) -> Path:
        return SHM_DIR / f"{self.prefix}{seq}"

    def _exists(self, path: Path) -> bool:
        return path.exists()

    def _release(self, path: Path) -> bool:
        _writing(path).unlink(missing_ok=True)  # (a write a lost producer never finished)
        if path.exists():
            path.unlink(missing_ok=True)
            return True
        return False


def _writing(path: Path) -> Path:
    """Where the producer writes the segment `path` before it publishes it."""
    return path.with_name(path.name + ".tmp")
