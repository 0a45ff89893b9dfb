"""The receiving end of a weight sync, in each engine's worker: receive every sender's buckets
through the transport (parallel/transports) and write them into the engine's parameters.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist

from llamarl.parallel.load_replay import LoadRecorder, split_rows, storage_id
from llamarl.parallel.receive_pool import ReceivePool, pool_slots
from llamarl.parallel.transports.base import Done, ReceiverTransport, Work
from llamarl.parallel.weight_plan import (
    DTYPES_BY_NAME,
    Bucket,
    Needs,
    TensorMeta,
    block_in,
    itemsize,
    merge_blocks,
    plan_buckets,
    slice_plan,
    solo_bytes_of,
)
from llamarl.runtime.job_store import connect_store


def check_complete(model: torch.nn.Module, loaded) -> None:
    """The first sync must write every engine parameter: the engines start from placeholder
    weights (vLLM's dummy load) and hold the trainer's only where a sync wrote them. vLLM's
    `load_weights` returns the names of the parameters it loaded (as its own checkpoint
    loader checks them); a model whose load_weights returns nothing is not checked."""
    if not isinstance(loaded, set):
        return
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if missing:
        raise RuntimeError(
            f"weight sync: the trainer's weights leave {len(missing)} engine parameter(s) "
            f"unset ({', '.join(missing[:4])}): the trainer's model and the engine's differ "
            "in architecture (config.json); check the checkpoint's config")


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

    `replay=False`: what `load` writes into is not an engine's weights but anything with
    `load_weights` (an adapter of vLLM's, generator/lora_adapter.py), which gets every sync
    as (name, full tensor) pairs; nothing is recorded or resharded.

    `receive_buffers` K > 0 (sync.receive_buffers) with one sender, whose buckets hold whole
    tensors: the buckets share K receive buffers (parallel/receive_pool.py), each loaded into
    the engine before its buffer takes a later bucket, so the sync holds at most K buckets
    whatever the model's size. The first sync then calls `load_weights` once per bucket
    (recorded, as vLLM's own weight updates call it per tensor: a fused qkv/gate_up parameter
    takes each part from the call that brings it), later syncs replay bucket by bucket. Not
    with several senders (tensors split by rows over them complete only with the last
    sender's rows), nor for resharded tp > 1 engines (the blocks of later syncs are copied
    into the full buffers first), nor adapters (small): those keep a buffer per bucket.
    """

    def __init__(self, metas_by_sender: list[list[TensorMeta]], bucket_mb: int,
                 transport: ReceiverTransport, device: torch.device,
                 solo_mb: float | None = None, replay: bool = True, receive_buffers: int = 0):
        assert len(metas_by_sender) == transport.spec.senders
        assert replay or not (transport.spec.tp > 1 and transport.spec.reshard), \
            "a sync that is not replayed into the engine's weights is not resharded"
        assert receive_buffers >= 0
        self.into_weights = replay  # False: every sync goes to load_weights as it comes
        self.plans = [plan_buckets(m, bucket_mb << 20, solo_bytes_of(solo_mb))
                      for m in metas_by_sender]
        self.transport = transport
        self.device = device
        self.order = [m.name for m in metas_by_sender[0]]  # checkpoint order
        self.full = {m.name: m for ms in metas_by_sender for m in ms}
        self._resharded = transport.spec.tp > 1 and transport.spec.reshard
        # K shared receive buffers (class docstring); None: one buffer per bucket
        self.slots = pool_slots(len(self.plans), receive_buffers, replay, self._resharded)
        self.pool: ReceivePool | None = None
        self.peak_buffer_bytes = 0  # the largest pool built (pools replace each other)
        if self.slots is not None:
            self._use_pool(ReceivePool(self.plans[0], self.slots, device))
        else:
            self._index([[torch.empty(b.numel, dtype=DTYPES_BY_NAME[b.dtype], device=device)
                          for b in plan] for plan in self.plans])
        self.replay: list[list[tuple[list, list]]] | None = None  # [sender][bucket] (dsts, srcs)
        self.targets = self.flats  # [sender][bucket]: where a replayed sync receives it
        self.watch: list[tuple[torch.Tensor, int]] = []  # engine tensors and their addresses
        self.problem: str | None = None  # why loads are not replayed
        self._works: list[list[Work]] | None = None  # the sync posted, not yet loaded
        self._posted_early = False  # _works were posted by the last load (see _post_next)
        self._early_error: RuntimeError | None = None  # why they could not be
        # Resharded syncs (tp > 1; weight_plan.Needs): from the second sync on this tp rank
        # receives only the blocks it read on the first, `slices[s]` (buckets of SliceMeta)
        # from sender s into `slice_flats`, and copies them to their place in `flats`
        # (`slice_copies`), from where the recorded load is replayed as before.
        self.metas_by_sender = metas_by_sender
        self.bucket_mb, self.solo_mb = bucket_mb, solo_mb
        self.posted = 0  # syncs whose receives were posted
        self.needs: Needs | None = None
        self.slices: list[list[Bucket]] | None = None
        self.slice_flats: list[list[torch.Tensor]] = []
        self.slice_copies: list[list[tuple[list, list]]] = []
        self._works_sliced = False
        needs = transport.spec.options.get("needs")
        if self._resharded and needs is not None:
            # a replacement engine (generator/loop.py: join_as_replacement) joins after the
            # senders' first sync: resharded from its first, with the needs the job's engines
            # published (every engine of a layout loads alike)
            self.posted = 1
            self._reshard(None if needs == "full" else json.loads(needs), publish=False)

    def _index(self, flats: list[list[torch.Tensor]]) -> None:
        """Receive into `flats` ([sender][bucket]): index the pieces in them."""
        self.flats = flats
        # name -> [(sender, bucket index, rows [row0, row0 + rows) as a view of its buffer)]
        self.pieces: dict[str, list[tuple[int, int, TensorMeta, torch.Tensor]]] = {}
        for s, plan in enumerate(self.plans):
            for b, bucket in enumerate(plan):
                for meta, off in bucket.entries:
                    view = self.flats[s][b][off:off + meta.numel].view(meta.piece_shape)
                    self.pieces.setdefault(meta.name, []).append((s, b, meta, view))
        for parts in self.pieces.values():
            parts.sort(key=lambda p: p[2].row0)

    def _use_pool(self, pool: ReceivePool) -> None:
        """Receive through `pool` (one sender): flats are views of its slots, and targets
        those, or engine regions for the buckets received in place."""
        self.pool = pool
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, pool.bytes)
        # (a bucket received in place: its pieces are views of the engine region)
        flats = [f if f is not None else t.view(-1) for f, t in zip(pool.flats, pool.targets)]
        self._index([flats])
        self.targets = [pool.targets] if pool.in_place else self.flats

    @property
    def buffer_bytes(self) -> int:
        """Bytes of receive buffers this receiver holds now (the pool's slots, or a buffer
        per bucket, and the slice buffers of resharded syncs)."""
        if self.pool is not None:
            return self.pool.bytes
        own = sum(f.numel() * f.element_size() for fs in self.flats for f in fs)
        # (a slice bucket without copies is received straight into the engine's buffers)
        return own + sum(f.numel() * f.element_size()
                         for fs, cs in zip(self.slice_flats, self.slice_copies)
                         for f, (dsts, _) in zip(fs, cs) if dsts)

    def _post(self, targets: list[list[torch.Tensor]]) -> list[list[Work]]:
        """Post the receive of every bucket of every sender now (bucket b: tag b), round
        robin over the senders: a point-to-point send waits until its receive is posted, so
        every sender's first buckets can move while the rest are being posted."""
        # tp > 1, from the second sync: the messages for this tp rank alone (resharded)
        own = self._resharded and self.posted >= 1
        self.posted += 1
        if self.pool is not None:  # as many buckets as have a slot; the rest as slots free
            self.pool.start(self.transport)
            return []
        self._works_sliced = own and self.slices is not None
        if self._works_sliced:
            targets = self.slice_flats
        works: list[list[Work]] = [[] for _ in targets]
        self.transport.begin()
        if self.transport.ordered:
            # NCCL: sender by sender, each sender's broadcasts waited for (on NCCL a wait
            # orders the GPU streams and returns at once) before the next sender's are posted,
            # so this GPU runs one weight communicator at a time, in the same order on every
            # engine (docs/architecture.md, "NCCL order")
            for s, sender_targets in enumerate(targets):
                works[s] = [self.transport.receive(t, s, b, own)
                            for b, t in enumerate(sender_targets)]
                if s < len(targets) - 1:  # (no later sender to order after the last)
                    for work in works[s]:
                        work.wait()
                    # waited once: a gloo receive's work must not be waited again (its
                    # second wait waits for a second message, forever)
                    works[s] = [Done()] * len(works[s])
            return works
        for b in range(max((len(t) for t in targets), default=0)):
            for s, sender_targets in enumerate(targets):
                if b < len(sender_targets):
                    works[s].append(self.transport.receive(sender_targets[b], s, b, own))
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
            if self.pool is not None:  # every bucket into a slot again, to record
                self.pool = self.flats = self.pieces = None
                self._use_pool(ReceivePool(self.plans[0], self.slots, self.device))
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
        and the transport allows it (gloo point to point, files). A gloo send waits until its
        receive is posted: this way the
        trainers' sends move the moment they are posted, not when this generator comes back
        from a generation batch to post its receives (their publish and next optimizer step
        stop waiting for it), and the next load finds the bytes there (the tiny model's sync on
        the 2-core CPU went from 0.73-0.78x to 0.81-0.92x of a raw transfer). The buffers are
        free: this sync is in the engine. Not when buckets are received straight into the engine
        (it must not change while it generates), nor on NCCL (a pending broadcast would hold
        the GPU while it generates)."""
        if self.targets is self.flats and self.transport.posts_early:
            try:
                self._works = self._post(self.flats)  # (a pool: its first buckets)
            except RuntimeError as e:
                # A trainer rank has closed its connection, as it does after its last sync:
                # an error only if another sync is announced (see post).
                self._works, self._early_error = None, e
            self._posted_early = True

    def _load(self, model: torch.nn.Module) -> int:
        works, self._works = self._works, None
        assert works is not None, "post() the receives first"
        if self.pool is not None:
            return self._load_pooled(model)
        if self._works_sliced:  # the blocks to their place in flats; then as a full sync
            self._unpack_slices(works)
            works = [[Done()] * len(plan) for plan in self.plans]
        if self.replay is not None and self.targets is self.flats and self._moved():
            self.replay = None  # the engine moved: record again (all bytes go to self.flats)
        if self.replay is not None:
            _copy_as_they_arrive(works, self.replay)
            return len(self.order)
        if not self.into_weights:  # (an adapter: it takes the tensors as they come)
            model.load_weights(self._arrivals(works))
            return len(self.order)
        if self.problem is not None:
            model.load_weights(self._arrivals(works))
            return len(self.order)
        engine = list(model.parameters()) + list(model.buffers())
        recorder = LoadRecorder(engine, [f for flats in self.flats for f in flats])
        assembled: dict[int, tuple[str, torch.Tensor]] = {}
        with recorder:
            loaded = model.load_weights(self._arrivals(works, recorder, assembled))
        check_complete(model, loaded)
        self.problem = recorder.problem or self._plan_replay(recorder, assembled)
        if self.problem is not None:
            self.replay = None
            print(f"llamarl: weight syncs call model.load_weights every time: {self.problem}",
                  file=sys.stderr, flush=True)
        else:
            self.watch = recorder.watch
        if self._resharded and self.posted == 1:  # the first sync: what it read
            self._reshard(None if self.problem else self._needs(recorder, assembled))
        return len(self.order)

    # -- one sender, a pool of receive buffers ---------------------------------------------
    def _load_pooled(self, model: torch.nn.Module) -> int:
        """Bucket by bucket: wait for it, load or replay it into the engine, free its slot
        (which posts the receives that waited for one)."""
        pool = self.pool
        if self.replay is not None and not pool.in_place and self._moved():
            self.replay = None  # the engine moved: record again (every bucket is in a slot)
        n = len(self.plans[0])
        if self.replay is not None:
            with torch.no_grad():
                for b, (dsts, srcs) in enumerate(self.replay[0]):
                    pool.wait(b)
                    if dsts:
                        torch._foreach_copy_(dsts, srcs)
                    pool.done(b)
            return len(self.order)
        if self.problem is not None:
            for b in range(n):
                pool.wait(b)
                model.load_weights(self._bucket_items(b))
                pool.done(b)
            return len(self.order)
        engine = list(model.parameters()) + list(model.buffers())
        recorder = LoadRecorder(engine, pool.slots)
        loaded: set | None = set()
        spans = []  # bucket b's copies: recorder.copies[spans[b][0]:spans[b][1]]
        with recorder:
            for b in range(n):
                with recorder.paused():  # (the transport's own ops are not the load's)
                    pool.wait(b)
                first = len(recorder.copies)
                got = model.load_weights(self._bucket_items(b))
                loaded = loaded | got if isinstance(got, set) and loaded is not None else None
                spans.append((first, len(recorder.copies)))
                with recorder.paused():
                    pool.done(b)
        check_complete(model, loaded)
        self.problem = recorder.problem
        if self.problem is not None:
            print(f"llamarl: weight syncs call model.load_weights every time: {self.problem}",
                  file=sys.stderr, flush=True)
            return len(self.order)
        self.watch = recorder.watch
        replay = self._pooled_replay(recorder.copies, spans)
        in_place = [self._in_place(pool.flats[b], *replay[b]) for b in range(n)]
        if not any(r is not None for r in in_place):
            self.replay = [replay]
            return len(self.order)
        # Buckets received in place need no slot: a smaller pool for the later syncs, the
        # recorded copies moved onto it (same offsets and strides in the same bucket).
        copies = [[] if region is not None else
                  [(d, tuple(v.shape), v.stride(), v.storage_offset()) for d, v in zip(*replay[b])]
                  for b, region in enumerate(in_place)]
        del recorder, replay, pool  # (the first pool is freed before the next is allocated)
        self.pool = self.flats = self.pieces = self.targets = None
        self._use_pool(ReceivePool(self.plans[0], self.slots, self.device, in_place))
        flats = self.pool.flats
        self.replay = [[([d for d, *_ in c], [flats[b].as_strided(*view) for _, *view in c])
                        for b, c in enumerate(copies)]]
        return len(self.order)

    def _bucket_items(self, b: int) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of every tensor in bucket b of the one sender (each comes whole)."""
        return [(meta.name, self.pieces[meta.name][0][3]) for meta, _ in self.plans[0][b].entries]

    def _pooled_replay(self, copies: list, spans: list[tuple[int, int]]) -> list[tuple[list, list]]:
        """The recorded copies of each bucket (those its load_weights call made). A copy
        from outside the bucket's bytes in its slot read a tensor that an earlier call gave
        and a later bucket may have overwritten: the load kept it across calls, and the
        weights may be wrong (RuntimeError)."""
        pool, out = self.pool, []
        slot_ids = [storage_id(s) for s in pool.slots]
        for b, (first, end) in enumerate(spans):
            flat, dsts, srcs = pool.flats[b], [], []
            for dst, src in copies[first:end]:
                start = src.storage_offset() * src.element_size()
                stop = start + src.element_size() * (1 + sum(
                    (n - 1) * st for n, st in zip(src.shape, src.stride())))
                if (storage_id(src) != slot_ids[pool.slot_of[b]] or start < 0
                        or stop > flat.numel() * flat.element_size()):
                    raise RuntimeError(
                        "weight sync: the engine's load_weights kept a received tensor from "
                        "one call to the next (a receive buffer had taken another bucket "
                        "meanwhile); set sync.receive_buffers=0 for a buffer per bucket")
                dsts.append(dst)
                srcs.append(src)
            out.append((dsts, srcs))
        return out

    # -- resharded syncs ------------------------------------------------------------------
    def _needs(self, recorder: LoadRecorder, assembled: dict) -> Needs | None:
        """The block of each received tensor that the recorded load read (None: some read
        is not a block of one tensor, so this rank keeps receiving everything)."""
        whole: dict[int, list[tuple[str, torch.Tensor]]] = {}  # buffer -> tensors in it
        for name, parts in self.pieces.items():
            if len(parts) == 1:
                whole.setdefault(storage_id(parts[0][3]), []).append((name, parts[0][3]))
        needs: Needs = {}
        for _, src in recorder.copies:
            sid = storage_id(src)
            candidates = [assembled[sid]] if sid in assembled else whole.get(sid, [])
            for name, base in candidates:
                block = block_in(src, base)
                if block is not None:
                    needs[name] = merge_blocks(needs.get(name), block)
                    break
            else:
                return None
        return needs

    def _reshard(self, needs: Needs | None, publish: bool = True) -> None:
        """Receive only `needs` from the second sync on, and tell the senders (the job store:
        `wsync/needs/<receiver>`, read by weight_sender at its second sync). None: receive
        everything, still as this tp rank's own messages."""
        self.needs = needs
        if needs is not None:
            solo = solo_bytes_of(self.solo_mb)
            self.slices = [plan_buckets(slice_plan(metas, needs), self.bucket_mb << 20, solo)
                           for metas in self.metas_by_sender]
            # A bucket of one block that is contiguous where it lands (rows of a piece: a
            # column-parallel weight's) is received there; the others into a buffer, copied.
            self.slice_flats, self.slice_copies = [], []
            for s, plan in enumerate(self.slices):
                flats, copies = [], []
                for bucket in plan:
                    dsts = [sm.of(next(v for s2, _, _, v in self.pieces[sm.name] if s2 == s))
                            for sm, _ in bucket.entries]
                    if len(dsts) == 1 and dsts[0].is_contiguous():
                        flats.append(dsts[0].view(-1))
                        copies.append(([], []))
                        continue
                    flat = torch.empty(bucket.numel, dtype=DTYPES_BY_NAME[bucket.dtype],
                                       device=self.device)
                    flats.append(flat)
                    copies.append((dsts, [flat[off:off + sm.numel].view(sm.piece_shape)
                                          for sm, off in bucket.entries]))
                self.slice_flats.append(flats)
                self.slice_copies.append(copies)
        spec = self.transport.spec
        if publish and spec.store is not None:
            host, port, prefix = spec.store
            store = dist.PrefixStore(prefix, connect_store(host, port, spec.timeout_s))
            store.set(f"wsync/needs/{spec.me}", "full" if needs is None else json.dumps(needs))

    def _unpack_slices(self, works: list[list[Work]]) -> None:
        """Wait for each block and copy it to its place in the receive buffers."""
        _copy_as_they_arrive(works, self.slice_copies)

    @property
    def bytes_per_sync(self) -> int:
        """Bytes this receiver gets per sync (resharded: its blocks alone)."""
        plans = self.slices if self.slices is not None else self.plans
        return sum(b.numel * itemsize(b.dtype) for plan in plans for b in plan)

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
        # (resharded: the receive buffers must hold every sync, the blocks are copied there)
        for s, b in [(s, b) for s, flats in enumerate(self.flats) for b in range(len(flats))
                     if not self._resharded]:
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


def _copy_as_they_arrive(works: list[list[Work]], copies: list[list[tuple[list, list]]]) -> None:
    """Wait for bucket b of each sender in turn (round robin over the senders, as they were
    posted) and run its copies `copies[s][b]` = (dsts, srcs) as soon as it is there."""
    with torch.no_grad():
        for b in range(max((len(w) for w in works), default=0)):
            for s, sender_works in enumerate(works):
                if b < len(sender_works):
                    sender_works[b].wait()
                    dsts, srcs = copies[s][b]
                    if dsts:
                        torch._foreach_copy_(dsts, srcs)
