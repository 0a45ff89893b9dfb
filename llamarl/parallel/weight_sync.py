"""Trainer -> generator weight sync: every trainer rank sends its own FSDP2 shard.

FSDP2 shards each parameter along dim 0 over the T trainer ranks. Instead of all-gathering the
full model among the trainers and sending it again from one rank, trainer rank r broadcasts
its local shards on its own group `wsync<r>` = [trainer r, every generator rank], and each
generator puts the rows back together. Every byte crosses the wire once, and the T trainer
links work in parallel.

Per sync i, on trainer r (all T in lockstep with the same version):
    trainer 0: store `wsync/version/<i>` = policy version        (one key: the announcement)
    flat_b[off_j : off_j + n_j] = local shard of tensor j        (bucket b: one dtype,
    post flat_b to every generator on wsync<r>, tag b               <= bucket_mb; in order)
    (a shard of >= sync.solo_mb is its own bucket, sent from the parameter itself; a shard
    already in the wire dtype lives in flat_b for good, see fsdp.place_shards: no copy)
and on each generator worker, woken by the announcement:
    post the receives of all buckets of all T senders into the receive buffers
    (on gloo, when all go into receive buffers: already posted by the last load)
    as each bucket arrives: write its rows into the engine's parameters
(see WeightReceiver: the first sync goes through vLLM's load_weights and is recorded, later
ones replay the recorded copies straight from the receive buffers, and receive a bucket that
holds one piece straight into the engine parameter).

Each sender publishes its shard layout once (`wsync/meta/<r>`: name, dtype, full shape, rows,
first row); replicated tensors (or a model without FSDP2) are sent by trainer 0 alone. The
announcement comes before the broadcast, so a generator waiting between two generation
batches posts its receives while the trainers pack, and receives every broadcast in order.
Send and receive buffers are allocated once: one sync is in flight at a time. The messages
go through groups.post_to_all: NCCL broadcasts on GPU; gloo's point-to-point send and recv
on CPU, every message of a sync posted at once.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llamarl.parallel.fsdp import place_shards
from llamarl.parallel.groups import point_to_point, post_from_root, post_to_all
from llamarl.parallel.load_replay import LoadRecorder, split_rows, storage_id

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                               torch.int64, torch.int32, torch.uint8, torch.int8, torch.bool)}


@dataclass(frozen=True)
class TensorMeta:
    """Rows [row0, row0 + rows) of the tensor `name` of full shape `shape`, as one sender
    holds them (rows = shape[0], row0 = 0 for a whole tensor)."""

    name: str
    dtype: str  # e.g. "torch.float32"
    shape: tuple[int, ...]
    rows: int = -1
    row0: int = 0

    @property
    def piece_shape(self) -> tuple[int, ...]:
        if not self.shape:
            return ()
        return (self.local_rows,) + tuple(self.shape[1:])

    @property
    def local_rows(self) -> int:
        if not self.shape:
            return 1
        return self.shape[0] if self.rows < 0 else self.rows

    @property
    def numel(self) -> int:
        n = 1
        for s in self.piece_shape:
            n *= s
        return n


@dataclass(frozen=True)
class Bucket:
    dtype: str
    entries: tuple[tuple[TensorMeta, int], ...]  # (meta, element offset in the flat buffer)
    numel: int


# A piece this large travels in a message of its own: the sender sends it straight from the
# parameter (no snapshot, see WeightSender.guard) and the receiver posts the message straight
# into the engine parameter it ends up in (see WeightReceiver): no copy at either end.
# Smaller pieces are packed into buckets, since every message costs a rendezvous. On this
# 2-core CPU (gloo, 110M model in 2 FSDP2 shards, bench/weight_sync.py), where each copy
# takes CPU from the loopback transfer: with gloo broadcasts (two in flight per group) 2 MiB
# did best (38 messages per sender, the attention shards packed; 0.78x of the raw transfer,
# against 0.69x for 1 MiB and for 16 MiB); with every message posted at once
# (groups.post_to_all) 1 MiB does best (86 messages, nothing copied; 0.85-0.92x against
# 0.78-0.82x for 2 MiB, runs side by side). The default of the recipe key sync.solo_mb.
SOLO_BYTES = 1 << 20


# A sync's message b carries tag b; other transfers on a weight group (the raw baselines of
# bench/weight_sync.py) use tags from here on, so they never match the receives that a
# generator posts early for the next sync (WeightReceiver._post_next).
OTHER_TAGS = 1 << 20


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int,
                 solo_bytes: int | None = None) -> list[Bucket]:
    """Group tensors by dtype (first-seen order), then pack each group into buckets of at most
    `bucket_bytes`; a piece of at least min(bucket_bytes, solo_bytes) (default SOLO_BYTES) gets
    a bucket of its own. Empty pieces are skipped."""
    solo_bytes = SOLO_BYTES if solo_bytes is None else solo_bytes
    by_dtype: dict[str, list[TensorMeta]] = {}
    for m in metas:
        if m.numel:
            by_dtype.setdefault(m.dtype, []).append(m)
    buckets: list[Bucket] = []
    for dtype, group in by_dtype.items():
        itemsize = torch.empty((), dtype=_DTYPES[dtype]).element_size()
        cap = max(1, bucket_bytes // itemsize)
        solo = max(1, min(bucket_bytes, solo_bytes) // itemsize)
        entries: list[tuple[TensorMeta, int]] = []
        used = 0
        for m in group:
            if m.numel >= solo:
                buckets.append(Bucket(dtype, ((m, 0),), m.numel))
                continue
            if entries and used + m.numel > cap:
                buckets.append(Bucket(dtype, tuple(entries), used))
                entries, used = [], 0
            entries.append((m, used))
            used += m.numel
        if entries:
            buckets.append(Bucket(dtype, tuple(entries), used))
    return buckets


def solo_bytes_of(solo_mb: float | None) -> int | None:
    """sync.solo_mb in bytes (None: SOLO_BYTES)."""
    return None if solo_mb is None else int(solo_mb * 2**20)


def metas_to_json(metas: list[TensorMeta]) -> str:
    return json.dumps([[m.name, m.dtype, list(m.shape), m.rows, m.row0] for m in metas])


def metas_from_json(text: str) -> list[TensorMeta]:
    return [TensorMeta(n, d, tuple(s), r, r0) for n, d, s, r, r0 in json.loads(text)]


def persistent_buffer_names(model: torch.nn.Module) -> set[str]:
    """Buffers that belong in a checkpoint (not e.g. rotary caches)."""
    keys = set(model.state_dict().keys())
    return {name for name, _ in model.named_buffers() if name in keys}


def model_tensors(model: torch.nn.Module,
                  buffers: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Parameters (tied ones once) and persistent buffers, by their checkpoint names."""
    out = dict(model.named_parameters())
    if buffers is None:
        buffers = persistent_buffer_names(model)
    for name, buf in model.named_buffers():
        if name in buffers:
            out[name] = buf
    return out


def local_pieces(model: torch.nn.Module, rank: int, buffers: set[str],
                 wire_dtype: torch.dtype | None = None,
                 ) -> list[tuple[TensorMeta, torch.Tensor | None]]:
    """What trainer `rank` sends: its dim-0 shard of each FSDP2 (Shard(0)) parameter, and whole
    replicated tensors on rank 0 only (None = nothing from this rank). Floating-point tensors
    travel as `wire_dtype` when given (the engines' dtype: float32 master weights are sent as
    bfloat16, cast while packing, at half the bytes)."""
    from torch.distributed.tensor import DTensor, Shard

    out = []
    for name, t in model_tensors(model, buffers).items():
        shape = tuple(t.shape)
        dtype = str(wire_dtype if wire_dtype is not None and t.is_floating_point() else t.dtype)
        if isinstance(t, DTensor) and tuple(t.placements) == (Shard(0),):
            local = t.to_local()
            world = t.device_mesh.size()
            chunk = -(-shape[0] // world)  # FSDP2 splits dim 0 like torch.chunk
            row0 = min(rank * chunk, shape[0])
            assert local.shape[0] == max(0, min(chunk, shape[0] - row0)), (name, local.shape)
            out.append((TensorMeta(name, dtype, shape, local.shape[0], row0), local))
        else:  # replicated or unsharded: trainer 0 sends the whole tensor
            full = t.full_tensor() if isinstance(t, DTensor) else t
            meta = TensorMeta(name, dtype, shape, -1 if rank == 0 else 0, 0)
            out.append((meta, full if rank == 0 else None))
    return out


class WeightSender:
    """Runs on every trainer rank r and sends r's shards on group `wsync<r>` (group rank 0).

    `publish` copies the shards into the send buffers (a snapshot: training may go on) and
    posts each bucket's message to every generator as soon as it is packed (groups.post_to_all:
    a broadcast on NCCL, point-to-point sends on gloo, whose completion a thread of the
    sender's own waits for). `wait` blocks until they are sent; one sync is in flight at a
    time, so the send buffers are allocated once and reused. All trainer ranks publish the
    same versions in the same order; trainer 0 announces broadcast i in `store` as one key,
    `wsync/version/<i>` = policy version, before sending it, so a generator waiting for that
    key posts its receives while the first bucket is being packed.

    A piece that travels alone (see SOLO_BYTES) and is already in the wire dtype, contiguous,
    on the device, is sent straight from the parameter: no snapshot, no send buffer. A smaller
    FSDP2 shard in the wire dtype is moved into its slot of a send buffer when the sender is
    built (fsdp.place_shards: the model's storage changes, its values do not), so packing
    skips it. Such parameters must then not change until they are sent: `guard(optimizer)`
    makes the optimizer's step wait for the sync in flight (by then it is long sent: a step
    takes longer than a sync).
    """

    def __init__(self, model: torch.nn.Module, rank: int, bucket_mb: int,
                 group: dist.ProcessGroup | None, device: torch.device, store=None,
                 wire_dtype: torch.dtype | None = None, solo_mb: float | None = None,
                 members: Members | None = None, lost_grace_s: float = 0.0):
        self.rank = rank
        # Who receives (trainer/weight_members.py): on gloo's point-to-point path each sync
        # goes to `members.targets()`, the engines alive; a send that fails because its
        # receiver died is forgiven once `members.lost()` names it (within lost_grace_s), and
        # a send that hangs on a lost receiver (its node is gone) is abandoned. A broadcast
        # (NCCL) cannot leave a member out: there a loss fails the job.
        self.members = members or Members(lambda: self.group)
        self.lost_grace_s = lost_grace_s
        self.buffers = persistent_buffer_names(model)
        self.metas = [m for m, _ in local_pieces(model, rank, self.buffers, wire_dtype)]
        self.buckets = plan_buckets(self.metas, bucket_mb << 20, solo_bytes_of(solo_mb))
        self.group = group
        self.device = device
        self.store = store
        self.bytes_per_sync = sum(b.numel * torch.empty((), dtype=_DTYPES[b.dtype]).element_size()
                                  for b in self.buckets)
        self.last_broadcast_s = 0.0
        # Where each tensor lives (its module's _parameters or _buffers dict, and its key),
        # resolved once: walking the module tree per sync cost ~0.5 ms for the tiny model.
        self._model = model
        tensors = model_tensors(model, self.buffers)
        self._sources = [(name, *_owner(model, name), _kind(t)) for name, t in tensors.items()]
        # Buckets sent straight from their one tensor (not a replicated one: that is gathered
        # anew every sync) get no buffer (None) and no slots.
        own = {}
        for name, _, _, kind in self._sources:
            if kind != "replicated":
                own[name] = tensors[name].to_local() if kind == "shard" else tensors[name]
        self.direct = [len(b.entries) == 1
                       and _sendable_as_is(own.get(b.entries[0][0].name), b, device)
                       for b in self.buckets]
        self._flats = [None if direct else torch.empty(b.numel, dtype=_DTYPES[b.dtype],
                                                       device=device)
                       for b, direct in zip(self.buckets, self.direct)]
        self._slots = [[] if flat is None else
                       [(m.name, flat[off:off + m.numel].view(m.piece_shape))
                        for m, off in b.entries] for b, flat in zip(self.buckets, self._flats)]
        self._shapes = [[slot.shape for _, slot in slots] for slots in self._slots]
        # FSDP2 shards that already are in the wire dtype move into their slots for good
        # (fsdp.place_shards): the parameter is the send buffer, and packing skips them.
        self.placed = place_shards(model, {name: slot for slots in self._slots
                                           for name, slot in slots})
        self._works: list[dist.Work] = []
        # gloo point to point: a thread waits for each sync's sends (see _track)
        self._waiter: threading.Thread | None = None
        self._in_flight: queue.SimpleQueue = queue.SimpleQueue()
        self._sent: threading.Event | None = None  # set when the sync in flight is sent
        self._failures: list[tuple[int, BaseException]] = []  # (receiver, why its send failed)
        self._blocked_on: int | None = None  # the receiver whose send the waiter waits for
        self._announced = 0

    def _local_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's piece of every tensor, by name (same pieces as `local_pieces`)."""
        out = {}
        for name, registry, key, kind in self._sources:
            # Read from the module's own dict: FSDP2 registers the sharded parameter there
            # again after every forward and backward, and Module.__getattr__ costs ~1.5 us
            # a tensor (a third of this loop's time for the tiny model).
            t = registry[key]
            if kind == "shard":
                # The shard itself. DTensor.to_local() returns it too, but as a fresh view
                # for a parameter (~2.5 us each): together these took 0.1 ms a sync for the
                # tiny model's 26 tensors on the 2-core CPU, half of its packing time.
                t = t._local_tensor
            elif kind == "replicated":  # a collective: every rank calls it, in the same order
                t = t.full_tensor()
            out[name] = t
        return out

    def send(self, model: torch.nn.Module) -> None:
        """Pack and broadcast now (pipelined bucket by bucket); returns when all is sent."""
        self.publish(model, version=None)
        self.wait()

    def publish(self, model: torch.nn.Module, version: int | None) -> None:
        """Announce the version (trainer 0; None: not announced), snapshot the shards bucket
        by bucket and post each bucket's broadcast at once; returns without waiting for them."""
        assert model is self._model, "a sender publishes the model it was built for"
        self.wait()  # the previous sync's buffers are free again
        if self.rank == 0 and version is not None:
            assert self.store is not None, "trainer 0 announces versions in the job store"
            self.store.set(f"wsync/version/{self._announced}", str(version))
            self._announced += 1
        t0 = time.perf_counter()
        works = []
        p2p = point_to_point(self.group)
        targets = self.members.targets() if p2p else []
        with torch.no_grad():
            local = self._local_tensors()
            for b, (bucket, slots, flat, shapes) in enumerate(zip(
                    self.buckets, self._slots, self._flats, self._shapes)):
                if flat is None:  # straight from the parameter (see guard)
                    (meta, _), = bucket.entries
                    works += self._post(local[meta.name].view(-1), b, p2p, targets)
                    continue
                pieces = [local[name] for name, _ in slots]
                assert [p.shape for p in pieces] == shapes, "a tensor changed shape since setup"
                # Pack what does not live in its slot (see place_shards), casting to the wire
                # dtype; a placed shard whose storage FSDP2 has replaced since is copied too.
                to_copy = [(slot, p) for (_, slot), p in zip(slots, pieces)
                           if p.data_ptr() != slot.data_ptr()]
                if to_copy:
                    dsts, srcs = zip(*to_copy)
                    torch._foreach_copy_(list(dsts), list(srcs))
                works += self._post(flat, b, p2p, targets)
        self._track(works, t0, p2p)

    def _post(self, tensor: torch.Tensor, tag: int, p2p: bool,
              targets: list[tuple[int, dist.ProcessGroup, int]]) -> list[tuple[int, dist.Work]]:
        """Post one bucket to each (receiver, group, group rank) of `targets` (p2p) or to the
        whole group; returns (receiver, work) pairs (receiver -1: the broadcast). A receiver
        whose send cannot even be posted (gloo raises at once when the peer has closed its
        connection) is left out of the rest of this sync and settled in `wait`."""
        if not p2p:
            return [(-1, w) for w in post_to_all(self.group, tensor, tag, p2p)]
        works = []
        for target in list(targets):
            receiver, group, dst = target
            try:
                works.append((receiver, group.send([tensor], dst, tag)))
            except RuntimeError as e:
                self._failures.append((receiver, e))
                targets.remove(target)
        return works

    def _track(self, pairs: list[tuple[int, dist.Work]], t0: float, p2p: bool) -> None:
        """Time the sync in flight (`last_broadcast_s`) and keep what `wait` waits for."""
        if not pairs:
            return
        if not p2p:  # a broadcast's future completes when it has been sent (NCCL: by the GPU)
            works = [w for _, w in pairs]
            futures = [w.get_future() for w in works]
            done = futures[0] if len(futures) == 1 else torch.futures.collect_all(futures)
            done.then(lambda _: setattr(self, "last_broadcast_s", time.perf_counter() - t0))
            self._works = works
            return

        # gloo's sends have no future: the sender's own thread waits for them (a work must
        # have only one waiter) and `wait` waits for its word. One thread for the sender's
        # life: starting a thread per sync cost ~0.5 ms on the 2-core CPU (start() waits
        # until the new thread runs), a quarter of a tiny model's sync.
        if self._waiter is None:
            self._in_flight = queue.SimpleQueue()  # this thread's own (see _abandon_lost)
            self._waiter = threading.Thread(target=self._wait_sends, daemon=True,
                                            args=(self._in_flight,), name="llamarl-wsync")
            self._waiter.start()
        self._sent = threading.Event()
        self._in_flight.put((pairs, t0, self._sent))

    def _wait_sends(self, in_flight: queue.SimpleQueue) -> None:
        """The waiter thread: wait for each sync's sends, time it, and say when it is done.
        A failed send is noted with its receiver and settled by `wait`."""
        me = threading.current_thread()
        while self._waiter is me:
            pairs, t0, sent = in_flight.get()
            failures = []
            for dst, w in pairs:
                if any(dst == d for d, _ in failures):
                    continue
                self._blocked_on = dst
                try:
                    w.wait()
                except BaseException as e:  # noqa: BLE001 - settled by wait()
                    failures.append((dst, e))
                if self._waiter is not me:  # abandoned while blocked on a lost receiver
                    return
            self._blocked_on = None
            self._failures += failures
            if not failures:
                self.last_broadcast_s = time.perf_counter() - t0
            sent.set()

    def _abandon_lost(self) -> bool:
        """The waiter is blocked on a send to a receiver that is lost (its node is gone, so
        nothing closes the connection): stop waiting for it. The thread is left to end on
        its own (gloo times the send out); the next sync starts a new one."""
        dst = self._blocked_on
        if dst is None or dst not in self.members.lost():
            return False
        self._waiter, self._blocked_on = None, None
        return True

    def _settle(self, failures: list[tuple[int, BaseException]]) -> None:
        """Forgive the sends that failed because their receiver died, once it is declared
        lost; anything else is an error."""
        deadline = time.monotonic() + self.lost_grace_s
        for dst, error in failures:
            while dst not in self.members.lost():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"weight broadcast failed: {error}") from error
                time.sleep(0.1)

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Make `optimizer.step()` wait for the sync in flight: some buckets are sent straight
        from the parameters, which the step changes in place."""
        optimizer.register_step_pre_hook(lambda _opt, _args, _kwargs: self.wait())

    def wait(self) -> None:
        """Block until the sync in flight (if any) has been sent."""
        works, self._works = self._works, []
        sent, self._sent = self._sent, None
        try:
            for w in works:
                w.wait()
        except BaseException as e:
            raise RuntimeError(f"weight broadcast failed: {e}") from e
        if sent is not None:
            while not sent.wait(0.5):
                if self._abandon_lost():
                    break
        failures, self._failures = self._failures, []
        self._settle(failures)


class Members:
    """Who receives a sender's syncs on gloo point to point: (receiver, group, group rank)
    for every receiver, and which receivers are lost. This default: every member of the
    sender's group but itself, none lost (trainer/weight_members.py knows the roster)."""

    def __init__(self, group: Callable[[], dist.ProcessGroup]):
        self.group = group

    def targets(self) -> list[tuple[int, dist.ProcessGroup, int]]:
        group = self.group()
        return [(d, group, d) for d in range(1, group.size())]

    def lost(self) -> set[int]:
        return set()


def _sendable_as_is(t: torch.Tensor | None, bucket: Bucket, device: torch.device) -> bool:
    """Whether `t`, a bucket's one piece, can be broadcast as it is (no copy into a buffer)."""
    device = torch.device(device)
    return (t is not None and t.is_contiguous() and str(t.dtype) == bucket.dtype
            and t.numel() == bucket.numel and t.device.type == device.type
            and (device.index is None or t.device.index == device.index))


def _kind(t: torch.Tensor) -> str:
    """How a trainer rank gets its piece of `t` (as in local_pieces)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return "plain"
    return "shard" if tuple(t.placements) == (Shard(0),) else "replicated"


def _owner(model: torch.nn.Module, name: str) -> tuple[dict, str]:
    """The dict that holds tensor `name` (its module's _parameters or _buffers) and its key."""
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path)
    return (module._parameters if attr in module._parameters else module._buffers), attr


def announced_version(store, index: int) -> int:
    """Policy version of broadcast number `index`, once announced. A receiver posts its
    receives as soon as it sees the announcement and reads the version while the bytes
    travel: one store round trip less before the transfer starts (~0.2 ms on the 2-core CPU,
    a tenth of a tiny sync); generator/weights.py: Announcements."""
    return int(store.get(f"wsync/version/{index}"))


class WeightReceiver:
    """Runs in each generator (vLLM worker) process: receive every sender's buckets into
    receive buffers (allocated once, reused every sync), and write them into the engine.

    First sync: the rows of each tensor are put together and handed to one
    `model.load_weights` call, recorded by `LoadRecorder`. Later syncs replay the recorded
    copies straight from the receive buffers into the engine's parameters, one
    `torch._foreach_copy_` per bucket as it arrives (rows of a sharded tensor go from each
    sender's buffer to their place, without being put together first). A bucket whose one
    recorded copy moves it whole into a contiguous engine region of the same dtype (a piece
    that travels alone, see SOLO_BYTES, loaded as is) is received in place: no copy at all.
    The constants the load writes (e.g. zeros in the padding rows of the vocabulary) are not
    written again: no copy writes there (LoadRecorder checks) and inference never writes
    weights, so they still hold. If the load cannot be replayed (see load_replay), every sync
    calls load_weights.

    A sync is `post` (the receives, at once) and `load` (wait, write into the engine), so the
    caller can do other work while the bytes travel; `receive` does both.
    """

    def __init__(self, metas_by_sender: list[list[TensorMeta]], bucket_mb: int,
                 groups: list[dist.ProcessGroup], device: torch.device,
                 solo_mb: float | None = None):
        assert len(metas_by_sender) == len(groups)
        self.plans = [plan_buckets(m, bucket_mb << 20, solo_bytes_of(solo_mb))
                      for m in metas_by_sender]
        self.groups = groups
        self.device = device
        self.order = [m.name for m in metas_by_sender[0]]  # checkpoint order
        self.full = {m.name: m for ms in metas_by_sender for m in ms}
        self.flats = [[torch.empty(b.numel, dtype=_DTYPES[b.dtype], device=device) for b in plan]
                      for plan in self.plans]
        # name -> [(sender, bucket index, rows [row0, row0 + rows) as a view of its buffer)]
        self.pieces: dict[str, list[tuple[int, int, TensorMeta, torch.Tensor]]] = {}
        for s, plan in enumerate(self.plans):
            for b, bucket in enumerate(plan):
                for meta, off in bucket.entries:
                    view = self.flats[s][b][off:off + meta.numel].view(meta.piece_shape)
                    self.pieces.setdefault(meta.name, []).append((s, b, meta, view))
        for parts in self.pieces.values():
            parts.sort(key=lambda p: p[2].row0)
        self.replay: list[list[tuple[list, list]]] | None = None  # [sender][bucket] (dsts, srcs)
        self.targets = self.flats  # [sender][bucket]: where a replayed sync receives it
        self.watch: list[tuple[torch.Tensor, int]] = []  # engine tensors and their addresses
        self.problem: str | None = None  # why loads are not replayed
        self._works: list[list[dist.Work]] | None = None  # the sync posted, not yet loaded
        self._posted_early = False  # _works were posted by the last load (see _post_next)
        self._early_error: RuntimeError | None = None  # why they could not be

    def _post(self, targets: list[list[torch.Tensor]]) -> list[list[dist.Work]]:
        """Post the receive of every bucket of every sender now (bucket b: tag b), round
        robin over the senders: a point-to-point send waits until its receive is posted, so
        every sender's first buckets can move while the rest are being posted."""
        works: list[list[dist.Work]] = [[] for _ in targets]
        p2p = [point_to_point(g) for g in self.groups]
        for b in range(max(len(t) for t in targets)):
            for s, (group, sender_targets) in enumerate(zip(self.groups, targets)):
                if b < len(sender_targets):
                    works[s].append(post_from_root(group, sender_targets[b], b, p2p[s]))
        return works

    def receive(self, model: torch.nn.Module) -> int:
        """Receive one full set of weights into `model` (a vLLM model: `load_weights`);
        returns the number of tensors written."""
        self.post()
        return self.load(model)

    def post(self) -> None:
        """Post the receives of the next sync and return at once (nothing to do if the last
        `load` posted them already, see _post_next): the bytes travel while the caller does
        other work; `load` finishes."""
        if self._posted_early:
            self._posted_early = False
            error, self._early_error = self._early_error, None
            if error is not None:
                raise RuntimeError(f"weight sync: a trainer rank closed its connection before "
                                   f"announcing this sync (it failed or quit): {error}") from error
            return
        assert self._works is None, "one sync at a time: load() the one posted first"
        # Did the engine's tensors move (then record again)? Checked before posting only
        # when some buckets are received straight into them; else while the bytes travel,
        # in load (~0.1 ms a sync off the critical path for the tiny model on the 2-core CPU).
        if self.replay is not None and self.targets is not self.flats and self._moved():
            self.replay, self.targets = None, self.flats
        self._works = self._post(self.targets)  # targets = flats unless replayed in place

    def _moved(self) -> bool:
        """Whether an engine tensor that the replay writes to has moved since it was recorded."""
        return any(t.data_ptr() != p for t, p in self.watch)

    def load(self, model: torch.nn.Module) -> int:
        """Wait for the sync that `post` started and write it into `model`; returns the
        number of tensors written."""
        assert not self._posted_early, "post() the receives first"
        written = self._load(model)
        self._post_next()
        return written

    def _post_next(self) -> None:
        """Post the next sync's receives now if every bucket goes into its receive buffer
        over gloo point to point. A gloo send waits until its receive is posted: this way the
        trainers' sends move the moment they are posted, not when this generator comes back
        from a generation batch to post its receives (their publish and next optimizer step
        stop waiting for it), and the next load finds the bytes there (the tiny model's sync on
        the 2-core CPU went from 0.73-0.78x to 0.81-0.92x of a raw transfer). The buffers are
        free: this sync is in the engine. Not when buckets are received straight into the engine
        (it must not change while it generates), nor on NCCL (a pending broadcast would hold
        the GPU while it generates)."""
        if self.targets is self.flats and all(point_to_point(g) for g in self.groups):
            try:
                self._works = self._post(self.flats)
            except RuntimeError as e:
                # A trainer rank has closed its connection, as it does after its last sync:
                # an error only if another sync is announced (see post).
                self._works, self._early_error = None, e
            self._posted_early = True

    def _load(self, model: torch.nn.Module) -> int:
        works, self._works = self._works, None
        assert works is not None, "post() the receives first"
        if self.replay is not None and self.targets is self.flats and self._moved():
            self.replay = None  # the engine moved: record again (all bytes go to self.flats)
        if self.replay is not None:
            with torch.no_grad():
                for b in range(max(len(w) for w in works)):  # round robin over senders
                    for s, sender_works in enumerate(works):
                        if b < len(sender_works):
                            sender_works[b].wait()
                            dsts, srcs = self.replay[s][b]
                            if dsts:
                                torch._foreach_copy_(dsts, srcs)
            return len(self.order)
        if self.problem is not None:
            model.load_weights(self._arrivals(works))
            return len(self.order)
        engine = list(model.parameters()) + list(model.buffers())
        recorder = LoadRecorder(engine, [f for flats in self.flats for f in flats])
        assembled: dict[int, tuple[str, torch.Tensor]] = {}
        with recorder:
            model.load_weights(self._arrivals(works, recorder, assembled))
        self.problem = recorder.problem or self._plan_replay(recorder, assembled)
        if self.problem is not None:
            self.replay = None
            print(f"llamarl: weight syncs call model.load_weights every time: {self.problem}",
                  file=sys.stderr, flush=True)
        else:
            self.watch = recorder.watch
        return len(self.order)

    def _arrivals(self, works, recorder: LoadRecorder | None = None,
                  assembled: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) as soon as all its rows have arrived; buckets are awaited round
        robin over senders, so loading overlaps the rest of the transfer."""
        count = {name: 0 for name in self.order}
        for b in range(max(len(w) for w in works)):
            ready = []
            for s, sender_works in enumerate(works):
                if b < len(sender_works):
                    sender_works[b].wait()
                    for meta, _ in self.plans[s][b].entries:
                        count[meta.name] += 1
                        if count[meta.name] == len(self.pieces[meta.name]):
                            ready.append(meta.name)
            for name in ready:
                parts = [view for _, _, _, view in self.pieces[name]]
                if len(parts) == 1:
                    yield name, parts[0]
                    continue
                if recorder is None:
                    yield name, torch.cat(parts)
                    continue
                with recorder.paused():
                    full = torch.cat(parts)
                recorder.add_received(full)
                assembled[storage_id(full)] = (name, full)
                yield name, full

    def _plan_replay(self, recorder: LoadRecorder, assembled: dict) -> str | None:
        """Group the recorded copies by the bucket their data arrives in; None if all map."""
        flat_of = {storage_id(f): (s, b) for s, flats in enumerate(self.flats)
                   for b, f in enumerate(flats)}
        replay = [[([], []) for _ in plan] for plan in self.plans]
        for dst, src in recorder.copies:
            sid = storage_id(src)
            if sid in flat_of:  # a tensor that one sender sends whole
                s, b = flat_of[sid]
                parts = [((s, b), dst, src)]
            else:  # a sharded tensor: take each sender's rows from its own buffer
                name, full = assembled[sid]
                parts = split_rows(dst, src, full, [((s, b), meta.row0, view)
                                                    for s, b, meta, view in self.pieces[name]])
                if parts is None:
                    return f"load_weights reads {name} in a way that does not follow its rows"
            for (s, b), d, v in parts:
                replay[s][b][0].append(d)
                replay[s][b][1].append(v)
        targets = [list(flats) for flats in self.flats]
        for s, b in [(s, b) for s, flats in enumerate(self.flats) for b in range(len(flats))]:
            region = self._in_place(self.flats[s][b], *replay[s][b])
            if region is not None:
                targets[s][b], replay[s][b] = region, ([], [])
        # self.targets is self.flats: every bucket is received into its buffer
        in_place = any(t is not f for ts, fs in zip(targets, self.flats) for t, f in zip(ts, fs))
        self.targets = targets if in_place else self.flats
        self.replay = replay
        return None

    @staticmethod
    def _in_place(flat: torch.Tensor, dsts: list, srcs: list) -> torch.Tensor | None:
        """The engine region that bucket `flat` can be received into directly, if its
        replay is one plain copy of the whole buffer into a contiguous region."""
        if len(dsts) != 1:
            return None
        dst, src = dsts[0], srcs[0]
        whole = (src.data_ptr() == flat.data_ptr() and src.numel() == flat.numel()
                 and src.is_contiguous())
        if whole and dst.is_contiguous() and dst.dtype == flat.dtype and dst.device == flat.device:
            return dst.view(-1)
        return None
