"""The filesystem transport (sync.transport: filesystem): buckets as safetensors files in a
directory that every trainer and engine sees (sync.transport_dir, e.g. a shared filesystem on
a cluster where the trainers and the engines cannot join one NCCL group; default: the run
directory).

    <dir>/s<r>/<sync>/b<tag>.safetensors     bucket `tag` of sync `sync` from trainer rank r
    <dir>/s<r>/<sync>/b<tag>.t<k>.safetensors  the same, for the tp rank k receivers alone
    <dir>/s<r>/<sync>/b<tag>[.t<k>].ack<j>   receiver j has read it

A sender writes each bucket to a temporary name and renames it, so a receiver never reads a
half-written file; its send is over once the file is there (the trainer does not wait for
the engines to read it). A receiver's receive waits for the file when the loader waits for
it, reads it into place and leaves its ack; the receiver that completes the acks removes the
bucket and the acks (the sender removes a sync's directory once it is empty). The job store
still carries the announcements and the shard layouts: only the bytes go through files. The
directory is per launch (Runtime.weight_transport adds the launch's run id), so neither a
restarted job nor another run sharing sync.transport_dir ever reads a file of this one.

When engines can be lost (sync.engine_loss: continue), a lost receiver's acks never come, so
its files would stay. Each receiver then also records the last sync it has read whole,

    <dir>/read.<j>                         receiver j has read every sync up to this one

and the sender's `members` (parallel/weight_members.py: FileMembers, which knows the roster)
says below which sync every live receiver, and every replacement about to start, is done:
the sender removes those syncs' directories whole at its next sync. A replacement receives
from the sync the trainers chose for it (TransportSpec.options["first_sync"]) under the
receiver number of the engine it replaces, so its acks complete the buckets again.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file, save_file

from llamarl.parallel.transports.base import (
    Done,
    ReceiverTransport,
    SenderTransport,
    TransportSpec,
    Work,
)

_KEY = "bucket"


class SweepMembers(Protocol):
    def begin(self, sync: int) -> int:
        """Sync `sync` starts; returns the first sync that a live receiver, or a replacement
        about to start, may still read (the sender removes every earlier one)."""


def read_mark(directory: Path, receiver: int) -> int:
    """The last sync receiver `receiver` has read whole (-1: none yet)."""
    try:
        return int((directory / f"read.{receiver}").read_text())
    except (FileNotFoundError, ValueError):
        return -1


def _sync_dir(spec: TransportSpec, sender: int, sync: int) -> Path:
    return Path(spec.directory) / f"s{sender}" / f"{sync:08d}"


class Sender(SenderTransport):
    def __init__(self, spec: TransportSpec,
                 members: Callable[[Sender], SweepMembers] | None = None):
        super().__init__(spec)
        self.sync = -1
        self._old: list[Path] = []  # directories of earlier syncs, removed once empty
        # engines can be lost (module docstring): who has read what
        self.members: SweepMembers | None = members(self) if members is not None else None

    def begin(self) -> None:
        self.sync += 1
        here = _sync_dir(self.spec, self.spec.me, self.sync)
        here.mkdir(parents=True, exist_ok=True)
        done = self.members.begin(self.sync) if self.members is not None else -1
        for old in list(self._old):  # read by every receiver: their files are gone
            try:
                if int(old.name) < done:  # what a lost receiver never acked goes too
                    shutil.rmtree(old)
                else:
                    old.rmdir()
                self._old.remove(old)
            except OSError:
                pass
        self._old.append(here)

    def send(self, tensor: torch.Tensor, tag: int,
             to: int | None = None) -> list[tuple[int, Work]]:
        path = _sync_dir(self.spec, self.spec.me, self.sync) / _name(tag, to)
        tmp = path.with_suffix(".tmp")
        save_file({_KEY: tensor.detach().to("cpu")}, str(tmp))
        os.replace(tmp, path)  # atomic: a receiver sees the whole file or none
        return [(-1, Done())]


def _name(tag: int, to: int | None) -> str:
    """Bucket `tag` for every receiver, or for tp rank `to`'s alone (resharded syncs)."""
    return f"b{tag}.safetensors" if to is None else f"b{tag}.t{to}.safetensors"


class _FileReceive:
    """A posted receive: wait() waits for the file, reads it into `tensor`, acks it.
    `readers`: the receivers that read this file."""

    def __init__(self, spec: TransportSpec, path: Path, tensor: torch.Tensor,
                 readers: list[int]):
        self.spec, self.path, self.tensor, self.readers = spec, path, tensor, readers
        self.done = False

    def wait(self) -> bool:
        if self.done:
            return True
        deadline = time.monotonic() + self.spec.timeout_s
        pause = 1e-4
        while not self.path.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"weight sync: {self.path} did not appear within sync.timeout_s "
                    f"{self.spec.timeout_s:g} s: is sync.transport_dir {self.spec.directory} "
                    "a directory that every trainer and engine sees?")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        data = load_file(str(self.path))[_KEY]
        if data.dtype != self.tensor.dtype or data.numel() != self.tensor.numel():
            raise RuntimeError(f"weight sync: {self.path} holds {data.numel()} x {data.dtype}, "
                               f"the plan expects {self.tensor.numel()} x {self.tensor.dtype}")
        with torch.no_grad():
            self.tensor.copy_(data.view(self.tensor.shape))
        self._ack()
        self.done = True
        return True

    def _ack(self) -> None:
        """Leave this receiver's ack; the last of them removes the bucket and the acks."""
        base = self.path.with_suffix("")
        Path(f"{base}.ack{self.spec.me}").touch()
        acks = [Path(f"{base}.ack{j}") for j in self.readers]
        if all(a.exists() for a in acks):
            for p in (self.path, *acks):
                p.unlink(missing_ok=True)


class Receiver(ReceiverTransport):
    def __init__(self, spec: TransportSpec):
        super().__init__(spec)
        self.sync = spec.options.get("first_sync", 0) - 1  # a replacement starts later
        self.first = self.sync + 1

    def begin(self) -> None:
        """The next sync's receives are posted: the previous one has been read whole (its
        load is over), which the sender's sweep reads (module docstring)."""
        if self.sync >= self.first:
            mark = Path(self.spec.directory) / f"read.{self.spec.me}"
            tmp = mark.with_name(f"{mark.name}.tmp")  # (one per receiver)
            tmp.write_text(str(self.sync))
            os.replace(tmp, mark)
        self.sync += 1

    def receive(self, tensor: torch.Tensor, sender: int, tag: int, own: bool = False) -> Work:
        path = _sync_dir(self.spec, sender, self.sync) / _name(tag, self.tp_rank if own else None)
        readers = [j for j in range(1, self.spec.receivers + 1)
                   if not own or (j - 1) % self.spec.tp == self.tp_rank]
        return _FileReceive(self.spec, path, tensor, readers)
