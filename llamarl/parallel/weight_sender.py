"""The sending end of a weight sync, on every trainer rank: pack this rank's shards into the
plan's buckets (parallel/weight_plan.py) and hand them to the transport (parallel/transports).

Per sync, on trainer r (all T in lockstep with the same version):
    trainer 0: store `wsync/version/<i>` = policy version        (one key: the announcement)
    flat_b[off_j : off_j + n_j] = local shard of tensor j        (bucket b: one dtype,
    post flat_b to every receiver, tag b                            <= bucket_mb; in order)
    (a shard of >= sync.solo_mb is its own bucket, sent from the parameter itself; a shard
    already in the wire dtype lives in flat_b for good, see fsdp.place_shards: no copy)
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable

import torch

from llamarl.parallel.adapters import (
    adapter_name,
    engine_name,
    is_adapter,
    merged_layers,
    merged_shard,
    sent_in_full,
)
from llamarl.parallel.fsdp import place_shards
from llamarl.parallel.transports.base import SenderTransport, Work
from llamarl.parallel.weight_plan import (
    DTYPES_BY_NAME,
    Bucket,
    TensorMeta,
    itemsize,
    local_pieces,
    model_tensors,
    persistent_buffer_names,
    plan_buckets,
    slice_plan,
    solo_bytes_of,
)


class WeightSender:
    """Runs on every trainer rank r and sends r's shards through its transport
    (parallel/transports: torch groups `wsync<r>` by default).

    `publish` copies the shards into the send buffers (a snapshot: training may go on) and
    posts each bucket's message to every generator as soon as it is packed (a broadcast on
    NCCL; point-to-point sends on gloo, or files, whose completion a thread of the sender's
    own waits for). `wait` blocks until they are sent; one sync is in flight at a
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

    `adapters` (model.lora.sync adapters): a LoRA policy's adapters alone, each rank its
    rows of every A and B (weight_plan.model_tensors), the same way as any FSDP2 shard.
    """

    def __init__(self, model: torch.nn.Module, rank: int, bucket_mb: int,
                 transport: SenderTransport | None, device: torch.device, store=None,
                 wire_dtype: torch.dtype | None = None, solo_mb: float | None = None,
                 lost_grace_s: float = 0.0, adapters: bool = False,
                 connect: Callable[[list[TensorMeta]], SenderTransport] | None = None):
        self.rank = rank
        # `connect(metas)`, instead of a `transport`: called once the shard layout (metas) is
        # known, it publishes the layout and builds the transport, so the receivers can build
        # theirs while this one connects (parallel/weight_sync.py). (None and no `connect`:
        # a sender for its layout and packing alone, as tests use it.)
        # A send that fails because its receiver died is forgiven once `transport.lost()`
        # names it (within lost_grace_s), and a send that hangs on a lost receiver (its node
        # is gone) is abandoned (the torch transport's Members: parallel/weight_members.py).
        self.transport = transport
        self.lost_grace_s = lost_grace_s
        self.buffers = persistent_buffer_names(model)
        self.metas = self._own_metas(model, wire_dtype, adapters)
        self._bucket_bytes, self._solo_bytes = bucket_mb << 20, solo_bytes_of(solo_mb)
        self.buckets = plan_buckets(self.metas, self._bucket_bytes, self._solo_bytes)
        self.syncs = 0  # syncs published
        self._blocks: list | None = None  # per tp rank (see _routes), from the second sync
        self.device = device
        self.store = store
        self.bytes_per_sync = self._bytes_sent()
        self.last_broadcast_s = 0.0
        # Where each tensor lives (its module's _parameters or _buffers dict, and its key),
        # resolved once: walking the module tree per sync cost ~0.5 ms for the tiny model.
        self._model = model
        tensors = model_tensors(model, self.buffers, adapters)
        # A LoRA policy's adapted linears (trainer/lora.py) are sent merged, W + s B A,
        # computed from this rank's rows every sync: kind "merged", its LoRA layer as source
        # (not when the adapters travel themselves).
        merged = {} if adapters else merged_layers(model)
        # the model's name of each tensor sent
        if adapters:
            origin = {adapter_name(n): n for n, _ in model.named_parameters() if is_adapter(n)}
        else:
            origin = {engine_name(n): n for n, _ in model.named_parameters() if sent_in_full(n)}
            origin.update((engine_name(n), n) for n, _ in model.named_buffers())
        self._sources = [(name, merged[name], None, "merged") if name in merged else
                         (name, *_owner(model, origin[name]), _kind(t))
                         for name, t in tensors.items()]
        self._alive: dict[str, torch.Tensor] = {}  # the sync in flight's merged pieces
        # merged pieces are made in the wire dtype: every one is alive until the sync's sends
        # are done, and packing would cast them to it anyway (half the memory in bfloat16)
        self._merged_dtype = {m.name: DTYPES_BY_NAME[m.dtype] for m in self.metas
                              if m.name in merged}
        self._plan_buffers(tensors, origin)
        self._works: list[tuple[int, Work]] = []  # (receiver, or -1: all) awaited by wait
        # gloo point to point: a thread waits for each sync's sends (see _track)
        self._waiter: threading.Thread | None = None
        self._in_flight: queue.SimpleQueue = queue.SimpleQueue()
        self._sent: threading.Event | None = None  # set when the sync in flight is sent
        self._failures: list[tuple[int, BaseException]] = []  # (receiver, why its send failed)
        self._blocked_on: int | None = None  # the receiver whose send the waiter waits for
        self._announced = 0
        if connect is not None:  # last: the receivers may build their end from here on
            self.transport = connect(self.metas)

    def _own_metas(self, model: torch.nn.Module, wire_dtype: torch.dtype | None,
                   adapters: bool) -> list[TensorMeta]:
        """The pieces this rank sends (its shards), as published to the receivers."""
        return [m for m, _ in local_pieces(model, self.rank, self.buffers, wire_dtype,
                                           adapters)]

    def _bytes_sent(self) -> int:
        return sum(b.numel * itemsize(b.dtype) for b in self.buckets)

    def _plan_buffers(self, tensors: dict[str, torch.Tensor], origin: dict[str, str]) -> None:
        """The send buffers: one per bucket, allocated once, with the shards in the wire
        dtype placed in their slots for good (`direct`, `_flats`, `_slots`, `placed`)."""
        model = self._model
        device = self.device
        # Buckets sent straight from their one tensor (not a replicated one: that is gathered
        # anew every sync) get no buffer (None) and no slots.
        own = {}
        for name, _, _, kind in self._sources:
            if kind in ("shard", "plain"):
                own[name] = tensors[name].to_local() if kind == "shard" else tensors[name]
        self.direct = [len(b.entries) == 1
                       and _sendable_as_is(own.get(b.entries[0][0].name), b, device)
                       for b in self.buckets]
        self._flats = [None if direct else torch.empty(b.numel, dtype=DTYPES_BY_NAME[b.dtype],
                                                       device=device)
                       for b, direct in zip(self.buckets, self.direct)]
        self._slots = [[] if flat is None else
                       [(m.name, flat[off:off + m.numel].view(m.piece_shape))
                        for m, off in b.entries] for b, flat in zip(self.buckets, self._flats)]
        self._shapes = [[slot.shape for _, slot in slots] for slots in self._slots]
        # FSDP2 shards that already are in the wire dtype move into their slots for good
        # (fsdp.place_shards, by the model's names): the parameter is the send buffer, and
        # packing skips them. (A LoRA layer's merged piece is no parameter: its W is never
        # placed in that slot, which packing overwrites.)
        kinds = {name: kind for name, _, _, kind in self._sources}
        self.placed = place_shards(model, {origin[name]: slot for slots in self._slots
                                           for name, slot in slots if kinds[name] != "merged"})

    def _local_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's piece of every tensor, by name (same pieces as `local_pieces`)."""
        out = {}
        for name, registry, key, kind in self._sources:
            # Read from the module's own dict: FSDP2 registers the sharded parameter there
            # again after every forward and backward, and Module.__getattr__ costs ~1.5 us
            # a tensor (a third of this loop's time for the tiny model).
            if kind == "merged":  # a collective (A is gathered): same order on every rank
                piece = merged_shard(registry)
                out[name] = piece.to(self._merged_dtype.get(name, piece.dtype))
                continue
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
        self._announce(version)
        t0 = time.perf_counter()
        works = []
        with torch.no_grad():
            local = self._local_tensors()
            # merged pieces are made for this sync: kept until it is sent (a resharded
            # sync may send a block straight from one)
            self._alive = local
            routes = self._routes(local)
            whole = [to for to, sliced in routes if sliced is None]  # who gets the full plan
            self.transport.begin()
            for b, (bucket, slots, flat, shapes) in enumerate(zip(
                    self.buckets, self._slots, self._flats, self._shapes)):
                if not whole:
                    break
                if flat is None:  # straight from the parameter (see guard)
                    (meta, _), = bucket.entries
                    for to in whole:
                        works += self.transport.send(local[meta.name].view(-1), b, to)
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
                for to in whole:
                    works += self.transport.send(flat, b, to)
            for to, sliced in routes:
                if sliced is not None:
                    works += self._send_blocks(sliced, local, to)
        self.syncs += 1
        self._track(works, t0, self.transport.point_to_point)

    def _announce(self, version: int | None) -> None:
        """Trainer 0: `wsync/version/<i>` = `version` for sync i (None: not announced)."""
        if self.rank == 0 and version is not None:
            assert self.store is not None, "trainer 0 announces versions in the job store"
            self.store.set(f"wsync/version/{self._announced}", str(version))
            self._announced += 1

    # -- resharded syncs (tp > 1 engines, weight_plan.Needs) ------------------------------
    def _routes(self, local: dict[str, torch.Tensor]) -> list[tuple[int | None, list | None]]:
        """Where this sync goes: [(None, None)], the full plan to every receiver; or, with
        tp > 1 from the second sync on, one route per tp rank k: (k, the blocks k reads, as
        (flat buffer, [(SliceMeta, its view of the buffer)]) per bucket), or (k, None) for a
        tp rank that receives the full plan."""
        tp = self.transport.spec.tp
        if tp == 1 or not self.transport.spec.reshard or self.syncs == 0:
            return [(None, None)]
        if self._blocks is None:
            self._blocks = [self._plan_blocks(needs, local) for needs in self._read_needs(tp)]
        return list(enumerate(self._blocks))

    def _read_needs(self, tp: int) -> list[dict | None]:
        """What each tp rank's receivers read, as they published it after the first sync
        (weight_receiver._reshard); the same for every engine of the layout."""
        assert self.store is not None, "resharded syncs read the receivers' needs in the store"
        by_rank: list[str | None] = [None] * tp
        for j in range(1, self.transport.spec.receivers + 1):
            text = self.store.get(f"wsync/needs/{j}").decode()
            k = (j - 1) % tp
            if by_rank[k] is not None and by_rank[k] != text:
                raise RuntimeError(f"weight sync: receivers of tp rank {k} read different parts "
                                   "of the weights (engines of one layout must load alike)")
            by_rank[k] = text
        return [None if text == "full" else json.loads(text) for text in by_rank]

    def _plan_blocks(self, needs: dict | None, local: dict[str, torch.Tensor]) -> list | None:
        """Buckets of the blocks `needs` asks for: (send buffer, [(SliceMeta, its view)]),
        or (None, [(SliceMeta, None)]) for a block sent straight from this rank's shard (one
        that travels alone, contiguous there, in the wire dtype: rows of a column-parallel
        weight; the guard covers it like any direct send)."""
        if needs is None:
            return None
        out = []
        for bucket in plan_buckets(slice_plan(self.metas, needs), self._bucket_bytes,
                                   self._solo_bytes):
            if len(bucket.entries) == 1:
                sm = bucket.entries[0][0]
                if _sendable_as_is(sm.of(local[sm.name]), bucket, self.device):
                    out.append((None, [(sm, None)]))
                    continue
            flat = torch.empty(bucket.numel, dtype=DTYPES_BY_NAME[bucket.dtype],
                               device=self.device)
            out.append((flat, [(sm, flat[off:off + sm.numel].view(sm.piece_shape))
                               for sm, off in bucket.entries]))
        return out

    def _send_blocks(self, blocks: list, local: dict[str, torch.Tensor],
                     to: int) -> list[tuple[int, Work]]:
        """Pack each bucket of tp rank `to`'s blocks (cast to the wire dtype) and send it."""
        works = []
        for b, (flat, entries) in enumerate(blocks):
            if flat is None:  # straight from the shard
                (sm, _), = entries
                works += self.transport.send(sm.of(local[sm.name]).view(-1), b, to)
                continue
            torch._foreach_copy_([view for _, view in entries],
                                 [sm.of(local[sm.name]) for sm, _ in entries])
            works += self.transport.send(flat, b, to)
        return works

    @property
    def bytes_last_sync(self) -> list[int]:
        """Bytes of the last sync per route: [full plan] or one per tp rank."""
        if self._blocks is None or self.syncs <= 1:
            return [self.bytes_per_sync]
        return [self.bytes_per_sync if blocks is None else
                sum(sm.numel * itemsize(sm.dtype) for _, entries in blocks for sm, _ in entries)
                for blocks in self._blocks]

    def _track(self, pairs: list[tuple[int, Work]], t0: float, p2p: bool) -> None:
        """Time the sync in flight (`last_broadcast_s`) and keep what `wait` waits for."""
        if not pairs:
            return
        if not p2p or self.device.type == "cuda":
            # a broadcast's future completes when it has been sent (NCCL: by the GPU). NCCL's
            # sends too (pair groups): their wait orders this thread's stream after them,
            # which the optimizer step that follows needs, so `wait` waits for them here.
            futures = [w.get_future() for _, w in pairs]
            done = futures[0] if len(futures) == 1 else torch.futures.collect_all(futures)
            done.then(lambda _: setattr(self, "last_broadcast_s", time.perf_counter() - t0))
            self._works = pairs
            return

        # gloo's sends (and files) have no future: the sender's own thread waits for them (a
        # work must have only one waiter) and `wait` waits for its word. One thread for the sender's
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
        if dst is None or dst not in self.transport.lost():
            return False
        self._waiter, self._blocked_on = None, None
        return True

    def _settle(self, failures: list[tuple[int, BaseException]]) -> None:
        """Forgive the sends that failed because their receiver died, once it is declared
        lost; anything else is an error."""
        deadline = time.monotonic() + self.lost_grace_s
        for dst, error in failures:
            while dst not in self.transport.lost():
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
        alive = self._alive  # noqa: F841 - freed when the sends below are done
        lost = self.transport.lost() if works and self.transport is not None else set()
        failed: list[tuple[int, BaseException]] = []
        for dst, w in works:  # (dst -1: a broadcast to every receiver)
            if dst in lost:  # its pair group was aborted (parallel/weight_members.py)
                continue
            try:
                w.wait()
            except BaseException as e:
                if dst < 0:
                    raise RuntimeError(f"weight broadcast failed: {e}") from e
                failed.append((dst, e))
        if sent is not None:
            while not sent.wait(0.5):
                if self._abandon_lost():
                    break
        failures, self._failures = self._failures + failed, []
        if self.transport is not None:  # sends that failed when posted (transport.send)
            failures, self.transport.failures = failures + self.transport.failures, []
        self._settle(failures)
        self._alive = {}




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
