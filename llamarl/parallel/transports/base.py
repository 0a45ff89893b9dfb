"""The two ends of a weight-sync transport (see __init__.py), and what they are built from.

A sync is a numbered series of messages per sender: bucket b of trainer rank r is message b
(its tag) from sender r, and every receiver gets all of them. A message is posted without
waiting, as a `Work` (anything with `wait()`), so a sender packs bucket b + 1 while bucket b
travels and a receiver loads bucket b while b + 1 travels. One sync is in flight at a time:
the sender reuses its buffers once `wait` says the last sync has left.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol

import torch

from llamarl.parallel.groups import GroupSpec


class Work(Protocol):
    def wait(self) -> object: ...


class Done:
    """A work that has already completed (a transport whose send is over when it returns)."""

    def wait(self) -> bool:
        return True


@dataclass(frozen=True)
class TransportSpec:
    """Where one end of a weight sync reaches the other; picklable (a vLLM worker process
    builds its receiver from it).

    `me`: the trainer rank (a sender), or the receiver's number, 1 + its place among the
    generator ranks (a receiver; as its rank in a torch weight group)."""

    name: str  # sync.transport
    me: int
    senders: int  # trainer ranks
    receivers: int  # generator ranks (engines x tp)
    groups: tuple[GroupSpec, ...] = ()  # torch: the sender's group, or one per sender
    directory: str = ""  # filesystem: the shared directory (sync.transport_dir)
    timeout_s: float = 600.0
    # Ranks per engine. With tp > 1 a sync from the second on goes to each tp rank apart
    # (resharded: every tp rank gets only the part of each tensor it reads); receiver j is
    # tp rank (j - 1) % tp of its engine.
    tp: int = 1
    reshard: bool = True  # sync.reshard: with tp > 1, send each tp rank only what it reads
    # torch on NCCL with tp > 1: the groups of one tp rank's receivers (sender: one per tp
    # rank, [sender, the receivers of that tp rank]; receiver: one per sender, its own tp rank)
    tp_groups: tuple[GroupSpec, ...] = ()
    store: tuple[str, int, str] | None = None  # the job store (host, port, prefix)
    # a custom transport's own; and a replacement's (generator/loop.py): "first_sync"
    # (filesystem), "needs" (tp > 1: what its tp rank reads, weight_receiver._reshard)
    options: dict = field(default_factory=dict, hash=False)


class SenderTransport(ABC):
    """Trainer rank `spec.me`'s end: send each bucket of a sync to every receiver."""

    # Each send completes on its own (per receiver) and a thread of the sender waits for
    # them; False: one collective per bucket, whose work has a future (NCCL broadcasts).
    point_to_point = True

    def __init__(self, spec: TransportSpec):
        self.spec = spec
        self.failures: list[tuple[int, BaseException]] = []  # (receiver, why), at posting

    def begin(self) -> None:  # noqa: B027 - a transport with nothing to do per sync
        """A sync starts: its buckets follow, in order, through `send`."""

    @abstractmethod
    def send(self, tensor: torch.Tensor, tag: int,
             to: int | None = None) -> list[tuple[int, Work]]:
        """Post bucket `tag` (1-D, contiguous) to every receiver, or with `to` only to the
        receivers of that tp rank (whose message `tag` it then is; resharded syncs);
        (receiver, work) pairs, receiver -1 for a work that covers several. The tensor must not
        change until the works are done."""

    def lost(self) -> set[int]:
        """Receivers that are gone for good (their sends are forgiven)."""
        return set()


class ReceiverTransport(ABC):
    """A receiver's end: receive bucket `tag` of each sender."""

    # Whether the next sync's receives may be posted right after a load (the trainers' sends
    # then leave while the engine generates); not when a pending receive holds the device.
    posts_early = True
    # Whether one sender's receives must be complete before the next sender's are posted:
    # NCCL, where each sender's broadcasts run on a communicator of their own, and NCCL
    # kernels of several communicators in flight on one GPU may deadlock unless every rank
    # orders them alike (docs/architecture.md, "NCCL order").
    ordered = False

    def __init__(self, spec: TransportSpec):
        self.spec = spec

    def begin(self) -> None:  # noqa: B027 - a transport with nothing to do per sync
        """A sync's receives are about to be posted."""

    @abstractmethod
    def receive(self, tensor: torch.Tensor, sender: int, tag: int, own: bool = False) -> Work:
        """Post the receive of bucket `tag` of `sender` into `tensor` (1-D, contiguous,
        written by the time the work's wait() returns); `own`: the message sent to this
        receiver's tp rank alone (send's `to`)."""

    @property
    def tp_rank(self) -> int:
        return (self.spec.me - 1) % self.spec.tp
