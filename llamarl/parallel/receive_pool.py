"""A bounded pool of receive buffers for a weight sync from one sender (sync.receive_buffers).

Without a pool an engine keeps one receive buffer per bucket: the whole model, on every tp
rank. With one sender every bucket holds whole tensors (weight_plan: trainer 0 sends them
whole), so bucket b can be loaded into the engine the moment it has arrived, and its buffer
reused. The pool has K slots; the buckets that need a buffer take them in turn (the i-th such
bucket: slot i % K), and a bucket whose data is received straight into the engine
(`in_place`) takes none. A sync then runs, for b = 0, 1, ...:

    wait(b)      bucket b has arrived (in its slot, or in the engine)
    (the caller loads or replays bucket b into the engine)
    done(b)      its slot is free: post the receives that were waiting for a slot

Receives are posted in bucket order, and one waits while its slot still holds an earlier
bucket (the ones after it wait too): on NCCL point-to-point messages of one communicator
match in the order they are posted. On NCCL `done(b)` posts the next receive into the slot
after the copies out of it were queued on the same stream (torch's NCCL process group makes
its stream wait for the current one), so a slot is never overwritten before it is read.

Each slot is a byte buffer as large as the largest bucket it takes; bucket b is a typed view
of its slot from byte 0, so the views a recorded load copies from (load_replay) are the same
every sync. Memory: the sum of the slots, at most K x the largest bucket (sync.bucket_mb, or
a tensor of sync.solo_mb and more, which travels alone).
"""

from __future__ import annotations

import torch

from llamarl.parallel.transports.base import ReceiverTransport, Work
from llamarl.parallel.weight_plan import DTYPES_BY_NAME, Bucket, itemsize


def pool_slots(senders: int, receive_buffers: int, into_weights: bool,
               resharded: bool) -> int | None:
    """The slots of a receiver's pool (sync.receive_buffers), or None where it keeps a buffer
    per bucket: several senders (a tensor split by rows over them is whole only with the last
    one's rows), an adapter's syncs (load_weights of another kind; small), a resharded tp > 1
    engine (later syncs' blocks are copied into the full buffers), or receive_buffers 0."""
    if receive_buffers and senders == 1 and into_weights and not resharded:
        return receive_buffers
    return None


def bucket_bytes(bucket: Bucket) -> int:
    return bucket.numel * itemsize(bucket.dtype)


def slot_sizes(plan: list[Bucket], slots: int, in_place: list[bool] | None = None) -> list[int]:
    """Bytes of each slot of a pool of `slots` for `plan` (the buckets not `in_place` take
    slot i % slots in turn; each slot as large as its largest bucket)."""
    assert slots >= 1
    sizes: list[int] = []
    buffered = [b for i, b in enumerate(plan) if not (in_place and in_place[i])]
    for i, bucket in enumerate(buffered):
        if i < slots:
            sizes.append(0)
        sizes[i % slots] = max(sizes[i % slots], bucket_bytes(bucket))
    return sizes


class ReceivePool:
    """The receive buffers of one sender's buckets `plan`: `slots` byte buffers taken in turn
    (module docstring); `in_place[b]`, when given, is the engine region bucket b is received
    into (no slot). Allocated by the constructor, kept for the receiver's life."""

    def __init__(self, plan: list[Bucket], slots: int, device: torch.device,
                 in_place: list[torch.Tensor | None] | None = None):
        self.plan = plan
        in_place = in_place or [None] * len(plan)
        self.slot_of: list[int | None] = [None] * len(plan)
        i = 0
        for b, region in enumerate(in_place):
            if region is None:
                self.slot_of[b], i = i % slots, i + 1
        sizes = slot_sizes(plan, slots, [r is not None for r in in_place])
        self.slots = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
        # bucket b's flat buffer: a typed view of its slot from byte 0 (None: in place)
        self.flats: list[torch.Tensor | None] = [
            None if s is None else
            self.slots[s][:bucket_bytes(bucket)].view(DTYPES_BY_NAME[bucket.dtype])
            for bucket, s in zip(plan, self.slot_of)]
        self.targets = [f if f is not None else r for f, r in zip(self.flats, in_place)]
        self._works: list[Work | None] = []
        self._holder: list[int | None] = []  # slot -> the bucket in it (None: free)
        self._next = 0  # the next bucket to post
        self._transport: ReceiverTransport | None = None

    @property
    def bytes(self) -> int:
        """Bytes of the pool's buffers."""
        return sum(s.numel() for s in self.slots)

    @property
    def in_place(self) -> bool:
        """Whether some bucket is received straight into the engine."""
        return any(s is None for s in self.slot_of)

    def start(self, transport: ReceiverTransport) -> None:
        """A sync starts: post the receives of the first buckets, as many as have a slot."""
        self._transport = transport
        self._works = [None] * len(self.plan)
        self._holder = [None] * len(self.slots)
        self._next = 0
        transport.begin()
        self._post_ready()

    def wait(self, b: int) -> None:
        """Wait until bucket b (buckets go in order) has arrived."""
        work = self._works[b]
        assert work is not None, f"bucket {b} was never posted: done() the ones before it"
        work.wait()

    def done(self, b: int) -> None:
        """Bucket b is in the engine: its slot takes the next bucket."""
        s = self.slot_of[b]
        if s is not None:
            assert self._holder[s] == b
            self._holder[s] = None
        self._works[b] = None
        self._post_ready()

    def _post_ready(self) -> None:
        assert self._transport is not None
        while self._next < len(self.plan):
            b, s = self._next, self.slot_of[self._next]
            if s is not None:
                if self._holder[s] is not None:
                    return  # in order: the buckets after b wait for b's slot too
                self._holder[s] = b
            self._works[b] = self._transport.receive(self.targets[b], 0, b)
            self._next += 1
