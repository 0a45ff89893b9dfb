"""One sender (sync.senders one, parallel/plan.py: `one_sender`): the trainer ranks all-gather
each bucket over the trainer group, and trainer 0 alone sends full tensors to the engines, on
its own groups (wsync0 or wsync0/pair<e>, and wsync0t<k> for resharded syncs). An engine GPU
is then in one weight group (+ one resharding group with tp > 1) whatever the trainer count;
the engines receive from one sender whose metas are the full tensors (WeightReceiver's
one-sender path, as with one trainer rank).

Every trainer rank plans the same buckets from the same full-tensor metas (rows -1). For
bucket b (`GatherPlan`), each rank contributes a padded flat of P elements: for each FSDP2
(Shard(0)) tensor j of the bucket, chunk_j = ceil(rows_j / T) rows (FSDP2's dim-0 split, as
in weight_plan.local_pieces) of inner_j elements, its own n_r,j <= chunk_j rows first, the rest
padding. `all_gather_single` puts rank r's flat at [r P, (r + 1) P) on every rank; trainer 0
copies rank r's rows of tensor j to rows [r chunk_j, r chunk_j + n_r,j) of the tensor's place in
the bucket (`unpack`). A replicated tensor (or a buffer) is not gathered: trainer 0 holds it
whole and copies it in. A bucket of one FSDP2 tensor needs no unpacking: the gathered flat's
first rows x inner elements are the tensor (only the last ranks' chunks are short).

Per sync, on every trainer rank, in bucket order:
    post the gather of bucket 0
    for b: wait for gather b; post gather b + 1        (it moves while trainer 0 sends b)
           trainer 0: unpack b, send it (or the blocks of it each tp rank reads, resharded)
Trainer 0 keeps at most MAX_IN_FLIGHT units' send buffers whose sends are not done (it waits
for the oldest before packing another; on NCCL a wait orders the streams and returns at once),
so its memory is a few buckets, never the model. Resharded syncs (tp > 1 from the second
sync): tp rank k's blocks are packed into buckets as the receivers plan them (plan_buckets of
slice_plan of the full metas); a block bucket is packed once the last full bucket it reads is
gathered, and a full bucket is dropped once no block bucket left reads it (with blocks of 1/tp
of each tensor a block bucket spans about tp full buckets: that many are held).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llamarl.parallel.weight_plan import (
    DTYPES_BY_NAME,
    Bucket,
    TensorMeta,
    itemsize,
    model_tensors,
    plan_buckets,
    slice_plan,
)
from llamarl.parallel.weight_sender import WeightSender, _sendable_as_is

# Units (a bucket to send to everyone or one tp rank) whose sends trainer 0 leaves in flight
# before it waits for the oldest: enough to keep the link busy while the next is packed.
MAX_IN_FLIGHT = 2


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """(first row, row count) of trainer rank `rank`'s FSDP2 dim-0 shard of a tensor of
    `rows` rows over `world` ranks: chunks of ceil(rows / world), the last ones short or
    empty (torch.chunk's split, as FSDP2 does)."""
    chunk = -(-rows // world)
    row0 = min(rank * chunk, rows)
    return row0, max(0, min(chunk, rows - row0))


@dataclass(frozen=True)
class GatherEntry:
    meta: TensorMeta  # the full tensor (rows -1)
    offset: int  # element offset of the tensor in the bucket's flat (the receivers' layout)
    chunk: int  # rows per trainer rank, ceil(rows / T); 0: not gathered (trainer 0's whole)
    inner: int  # elements per row
    padded_offset: int  # element offset of its chunk in each rank's padded flat


@dataclass(frozen=True)
class GatherPlan:
    """How one bucket is gathered: its entries and P, the elements each rank contributes."""
    bucket: Bucket
    entries: tuple[GatherEntry, ...]
    padded: int

    @property
    def alone(self) -> bool:
        """One gathered tensor and nothing else: the gathered flat holds it as it is."""
        return len(self.entries) == 1 and self.entries[0].chunk > 0


def gather_plan(bucket: Bucket, sharded: set[str], world: int) -> GatherPlan:
    """The gather of `bucket` (entries of full metas) over `world` trainer ranks; the tensors
    named in `sharded` are FSDP2 dim-0 shards, the others trainer 0 holds whole."""
    entries, padded = [], 0
    for meta, offset in bucket.entries:
        shape = meta.shape
        if meta.name in sharded and shape:
            chunk, inner = -(-shape[0] // world), math.prod(shape[1:])
        else:
            chunk, inner = 0, 0
        entries.append(GatherEntry(meta, offset, chunk, inner, padded))
        padded += chunk * inner
    return GatherPlan(bucket, tuple(entries), padded)


def padded_input(plan: GatherPlan, pieces: dict[str, torch.Tensor], rank: int, world: int,
                 device: torch.device) -> torch.Tensor:
    """Rank `rank`'s contribution to the gather of `plan`'s bucket: [P] in the bucket's dtype,
    its rows of each gathered tensor (`pieces`: name -> its local shard) at the start of the
    tensor's chunk. A bucket of one shard that fills its chunk and is already in the wire
    dtype is contributed as it is (the parameter itself: the gather is done before publish
    returns, so the optimizer may change it after)."""
    dtype = DTYPES_BY_NAME[plan.bucket.dtype]
    if plan.alone:
        e = plan.entries[0]
        piece = pieces[e.meta.name]
        if piece.numel() == e.chunk * e.inner and _sendable_as_is(
                piece, Bucket(plan.bucket.dtype, (), plan.padded), device):
            return piece.view(-1)
    flat = torch.empty(plan.padded, dtype=dtype, device=device)
    dsts, srcs = [], []
    for e in plan.entries:
        if not e.chunk:
            continue
        _, n = shard_rows(e.meta.shape[0], world, rank)
        piece = pieces[e.meta.name]
        assert piece.shape[0] == n, (e.meta.name, tuple(piece.shape), n)
        if n:
            dsts.append(flat[e.padded_offset:e.padded_offset + n * e.inner])
            srcs.append(piece.reshape(-1))
    if dsts:
        torch._foreach_copy_(dsts, srcs)
    return flat


def unpack(plan: GatherPlan, gathered: torch.Tensor, whole: dict[str, torch.Tensor],
           world: int, device: torch.device) -> torch.Tensor:
    """The bucket's flat as the receivers lay it out (full tensors at their offsets) from the
    gathered [world x P] flat; the tensors not gathered are copied from `whole` (trainer 0's
    own, cast to the wire dtype). A bucket of one gathered tensor is a view of `gathered`."""
    if plan.alone:
        return gathered[:plan.bucket.numel]
    flat = torch.empty(plan.bucket.numel, dtype=DTYPES_BY_NAME[plan.bucket.dtype], device=device)
    dsts, srcs = [], []
    for e in plan.entries:
        if not e.chunk:
            dsts.append(flat[e.offset:e.offset + e.meta.numel])
            srcs.append(whole[e.meta.name].reshape(-1))
            continue
        rows = e.meta.shape[0]
        for r in range(world):
            row0, n = shard_rows(rows, world, r)
            if n:
                at = r * plan.padded + e.padded_offset
                dsts.append(flat[e.offset + row0 * e.inner:e.offset + (row0 + n) * e.inner])
                srcs.append(gathered[at:at + n * e.inner])
    if dsts:
        torch._foreach_copy_(dsts, srcs)
    return flat


@dataclass(frozen=True)
class Unit:
    """One message of a sync: bucket `tag` of route `to` (None: the full plan to every
    receiver; k: tp rank k's), packed from the full buckets first .. last (their indices)."""
    to: int | None
    tag: int
    bucket: Bucket  # of TensorMeta (the full bucket `first`) or of SliceMeta (blocks)
    first: int
    last: int
    blocks: bool


class OneSender(WeightSender):
    """A trainer rank's end of a one-sender sync: every rank gathers, trainer 0 sends.

    Built on every trainer rank with the same full-tensor metas and buckets; only trainer 0
    has a transport (`connect` is called there alone, and only its metas are published:
    `wsync/meta/0`). `publish` is a collective over the trainer group (the default process
    group: every trainer rank calls it for the same syncs in the same order), `wait` and
    `guard` as WeightSender's."""

    def __init__(self, model: torch.nn.Module, rank: int, world: int, bucket_mb: int,
                 device: torch.device, store=None, wire_dtype: torch.dtype | None = None,
                 solo_mb: float | None = None, lost_grace_s: float = 0.0,
                 adapters: bool = False, connect=None, group=None):
        self.world, self.group = world, group  # the trainer group (None: the default one)
        self._units_resharded: list[Unit] | None = None
        self._held: list[torch.Tensor] = []  # send buffers whose sends `wait` waits for
        super().__init__(model, rank, bucket_mb, None, device, store, wire_dtype=wire_dtype,
                         solo_mb=solo_mb, lost_grace_s=lost_grace_s, adapters=adapters,
                         connect=connect if rank == 0 else None)

    def _own_metas(self, model, wire_dtype, adapters) -> list[TensorMeta]:
        """Every tensor whole, on every rank (the metas of `local_pieces` but whole: the
        same names, order, full shapes and wire dtypes)."""
        return [TensorMeta(name, str(wire_dtype if wire_dtype is not None
                                     and t.is_floating_point() else t.dtype), tuple(t.shape))
                for name, t in model_tensors(model, self.buffers, adapters).items()]

    def _bytes_sent(self) -> int:
        return super()._bytes_sent() if self.rank == 0 else 0

    def _plan_buffers(self, tensors, origin) -> None:
        """No send buffers for good: a bucket's is made when it is gathered."""
        from torch.distributed.tensor import DTensor, Shard

        def sharded(registry, key, kind) -> bool:
            if kind == "merged":  # W + s B A by W's rows (adapters.merged_shard)
                t = registry.base_layer.weight
                return isinstance(t, DTensor) and tuple(t.placements) == (Shard(0),)
            return kind == "shard"

        names = {name for name, registry, key, kind in self._sources
                 if sharded(registry, key, kind)}
        self.gathers = [gather_plan(b, names, self.world) for b in self.buckets]
        self.direct = [False] * len(self.buckets)
        self._flats, self._slots, self._shapes = [], [], []
        self.placed = set()
        # where each tensor is in the full buckets (resharded syncs slice blocks out of it)
        self._bucket_of = {m.name: b for b, bucket in enumerate(self.buckets)
                           for m, _ in bucket.entries}
        self._offset_of = {m.name: off for bucket in self.buckets for m, off in bucket.entries}

    def publish(self, model: torch.nn.Module, version: int | None) -> None:
        """Announce (trainer 0), gather every bucket in order (every rank) and send each as
        soon as it is gathered (trainer 0); returns with the last sends in flight."""
        assert model is self._model, "a sender publishes the model it was built for"
        self.wait()
        self._announce(version)
        t0 = time.perf_counter()
        sending = self.transport is not None
        with torch.no_grad():
            local = self._local_tensors()
            self._alive = local
            if sending:
                self.transport.begin()
            units = self._units() if sending else []
            # full buckets before the first one that the units left read are dropped
            keep_from = self._keep_from(units)
            next_unit, window = 0, {}
            in_flight: deque = deque()
            pending = self._gather(0, local)
            for b in range(len(self.buckets)):
                gathered = pending.result()
                pending = self._gather(b + 1, local) if b + 1 < len(self.buckets) else None
                if not sending:
                    continue
                window[b] = unpack(self.gathers[b], gathered, local, self.world, self.device)
                while next_unit < len(units) and units[next_unit].last == b:
                    unit = units[next_unit]
                    next_unit += 1
                    if len(in_flight) >= MAX_IN_FLIGHT:
                        self._finish(in_flight.popleft()[1])
                    flat = self._pack(unit, window)
                    in_flight.append((flat, self.transport.send(flat, unit.tag, unit.to)))
                keep = keep_from[next_unit] if next_unit < len(units) else b + 1
                for old in [g for g in window if g < keep]:
                    del window[old]
            assert next_unit == len(units), "every unit is sent"
        self.syncs += 1
        self._held = [flat for flat, _ in in_flight]
        self._track([w for _, works in in_flight for w in works], t0,
                    sending and self.transport.point_to_point)

    def _gather(self, b: int, local: dict[str, torch.Tensor]) -> _Gathered:
        """Post the gather of bucket b (every trainer rank); nothing to gather when each of
        its tensors is trainer 0's whole."""
        plan = self.gathers[b]
        if not plan.padded:
            return _Gathered(None, None)
        inp = padded_input(plan, local, self.rank, self.world, self.device)
        out = torch.empty(self.world * plan.padded, dtype=inp.dtype, device=self.device)
        return _Gathered(out, dist.all_gather_single(out, inp, group=self.group,
                                                     async_op=True))

    def _pack(self, unit: Unit, window: dict[int, torch.Tensor]) -> torch.Tensor:
        """Unit's message: its full bucket as gathered, or its blocks of the gathered tensors."""
        if not unit.blocks:
            return window[unit.first]
        flat = torch.empty(unit.bucket.numel, dtype=DTYPES_BY_NAME[unit.bucket.dtype],
                           device=self.device)
        dsts, srcs = [], []
        for sm, off in unit.bucket.entries:
            m = sm.piece
            g, at = self._bucket_of[m.name], self._offset_of[m.name]
            full = window[g][at:at + m.numel].view(m.piece_shape)
            dsts.append(flat[off:off + sm.numel].view(sm.piece_shape))
            srcs.append(sm.of(full))
        torch._foreach_copy_(dsts, srcs)
        return flat

    def _units(self) -> list[Unit]:
        """The messages of this sync in the order they are sent: the full plan to every
        receiver; or, resharded (tp > 1 from the second sync on), each tp rank's blocks (or
        full plan, for a tp rank that reads everything), ordered by the last full bucket each
        reads (stable: each tp rank's in tag order)."""
        tp = self.transport.spec.tp
        if tp == 1 or not self.transport.spec.reshard or self.syncs == 0:
            return [Unit(None, b, bucket, b, b, False) for b, bucket in enumerate(self.buckets)]
        if self._units_resharded is None:
            units = []
            for k, needs in enumerate(self._read_needs(tp)):
                if needs is None:
                    units += [Unit(k, b, bucket, b, b, False)
                              for b, bucket in enumerate(self.buckets)]
                    continue
                for b, bucket in enumerate(plan_buckets(slice_plan(self.metas, needs),
                                                        self._bucket_bytes, self._solo_bytes)):
                    read = [self._bucket_of[sm.name] for sm, _ in bucket.entries]
                    units.append(Unit(k, b, bucket, min(read), max(read), True))
            units.sort(key=lambda u: u.last)
            self._units_resharded = units
        return self._units_resharded

    @staticmethod
    def _keep_from(units: list[Unit]) -> list[int]:
        """For each unit i, the first full bucket that units i, i + 1, ... read (a later
        unit may read an earlier bucket than unit i: the suffix minimum of `first`)."""
        keep, low = [0] * len(units), math.inf
        for i in range(len(units) - 1, -1, -1):
            low = min(low, units[i].first)
            keep[i] = low
        return keep

    def _finish(self, works: list) -> None:
        """Wait for one unit's sends (its buffer is then free); a send to a receiver that
        failed is settled by `wait` (forgiven once that engine is declared lost)."""
        for dst, w in works:
            try:
                w.wait()
            except BaseException as e:  # noqa: BLE001 - settled by wait()
                if dst < 0:
                    raise RuntimeError(f"weight broadcast failed: {e}") from e
                self._failures.append((dst, e))

    def wait(self) -> None:
        super().wait()
        self._held = []

    @property
    def bytes_last_sync(self) -> list[int]:
        """Bytes of the last sync per route: [full plan] or one per tp rank."""
        if self._units_resharded is None or self.syncs <= 1:
            return [self.bytes_per_sync]
        out: dict[int, int] = {}
        for u in self._units_resharded:
            out[u.to] = out.get(u.to, 0) + u.bucket.numel * itemsize(u.bucket.dtype)
        return [out[k] for k in sorted(out)]


class _Gathered:
    """A posted gather: `result()` waits for it and returns the gathered flat."""

    def __init__(self, out: torch.Tensor | None, work):
        self.out, self.work = out, work

    def result(self) -> torch.Tensor | None:
        if self.work is not None:
            self.work.wait()
        return self.out
