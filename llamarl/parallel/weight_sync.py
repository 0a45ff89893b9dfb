"""Trainer -> generator weight sync: every trainer rank sends its own FSDP2 shard.

FSDP2 shards each parameter along dim 0 over the T trainer ranks. Instead of all-gathering the
full model among the trainers and sending it again from one rank, trainer rank r broadcasts
its local shards on its own group `wsync<r>` = [trainer r, every generator rank], and each
generator puts the rows back together. Every byte crosses the wire once, and the T trainer
links work in parallel.

Per sync, on trainer r (all T in lockstep with the same version):
    flat_b[off_i : off_i + n_i] = local shard of tensor i  (bucket b: one dtype, <= bucket_mb)
    broadcast(flat_b, root=r on wsync<r>)                  for every bucket, in a thread
and on each generator worker:
    receive all buckets of all T senders (asynchronously, then wait)
    full_i = cat(rows of tensor i from every sender, dim 0); load_weights([(name_i, full_i)])

Each sender publishes its shard layout once (`wsync/meta/<r>`: name, dtype, full shape, rows,
first row); replicated tensors (or a model without FSDP2) are sent by trainer 0 alone. Trainer
0 announces broadcast i in the store (`wsync/count` = i + 1, `wsync/version/<i>` = policy
version) before sending it, so a generator can see between two generation batches that
weights are waiting, and receive every broadcast in order.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llamarl.parallel.groups import broadcast

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


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Group tensors by dtype (first-seen order), then pack each group into buckets of at most
    `bucket_bytes` (a larger tensor gets a bucket of its own). Empty pieces are skipped."""
    by_dtype: dict[str, list[TensorMeta]] = {}
    for m in metas:
        if m.numel:
            by_dtype.setdefault(m.dtype, []).append(m)
    buckets: list[Bucket] = []
    for dtype, group in by_dtype.items():
        itemsize = torch.empty((), dtype=_DTYPES[dtype]).element_size()
        cap = max(1, bucket_bytes // itemsize)
        entries: list[tuple[TensorMeta, int]] = []
        used = 0
        for m in group:
            if entries and used + m.numel > cap:
                buckets.append(Bucket(dtype, tuple(entries), used))
                entries, used = [], 0
            entries.append((m, used))
            used += m.numel
        if entries:
            buckets.append(Bucket(dtype, tuple(entries), used))
    return buckets


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


def local_pieces(model: torch.nn.Module, rank: int,
                 buffers: set[str]) -> list[tuple[TensorMeta, torch.Tensor | None]]:
    """What trainer `rank` sends: its dim-0 shard of each FSDP2 (Shard(0)) parameter, and whole
    replicated tensors on rank 0 only (None = nothing from this rank)."""
    from torch.distributed.tensor import DTensor, Shard

    out = []
    for name, t in model_tensors(model, buffers).items():
        shape = tuple(t.shape)
        if isinstance(t, DTensor) and tuple(t.placements) == (Shard(0),):
            local = t.to_local()
            world = t.device_mesh.size()
            chunk = -(-shape[0] // world)  # FSDP2 splits dim 0 like torch.chunk
            row0 = min(rank * chunk, shape[0])
            assert local.shape[0] == max(0, min(chunk, shape[0] - row0)), (name, local.shape)
            out.append((TensorMeta(name, str(t.dtype), shape, local.shape[0], row0), local))
        else:  # replicated or unsharded: trainer 0 sends the whole tensor
            full = t.full_tensor() if isinstance(t, DTensor) else t
            meta = TensorMeta(name, str(t.dtype), shape, -1 if rank == 0 else 0, 0)
            out.append((meta, full if rank == 0 else None))
    return out


class WeightSender:
    """Runs on every trainer rank r and sends r's shards on group `wsync<r>` (group rank 0).

    `send` packs and broadcasts inline; `publish` packs inline and broadcasts from a
    background thread (one sync in flight at a time). All trainer ranks publish the same
    versions in the same order; trainer 0 announces them in `store`.
    """

    def __init__(self, model: torch.nn.Module, rank: int, bucket_mb: int,
                 group: dist.ProcessGroup | None, device: torch.device, store=None):
        self.rank = rank
        self.buffers = persistent_buffer_names(model)
        self.metas = [m for m, _ in local_pieces(model, rank, self.buffers)]
        self.buckets = plan_buckets(self.metas, bucket_mb << 20)
        self.group = group
        self.device = device
        self.store = store
        self.bytes_per_sync = sum(b.numel * torch.empty((), dtype=_DTYPES[b.dtype]).element_size()
                                  for b in self.buckets)
        self.last_broadcast_s = 0.0
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def pack(self, model: torch.nn.Module) -> Iterator[torch.Tensor]:
        """This rank's shards copied into flat per-bucket buffers (a snapshot), bucket by
        bucket, so the broadcast of one bucket can overlap the packing of the next."""
        pieces = {m.name: t for m, t in local_pieces(model, self.rank, self.buffers)}
        for bucket in self.buckets:
            flat = torch.empty(bucket.numel, dtype=_DTYPES[bucket.dtype], device=self.device)
            for meta, off in bucket.entries:
                flat[off:off + meta.numel].copy_(pieces[meta.name].detach().reshape(-1))
            yield flat

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="llamarl-wsync", daemon=True)
            self._thread.start()

    def send(self, model: torch.nn.Module) -> None:
        """Pack and broadcast now (pipelined bucket by bucket); returns when all is sent."""
        self.publish(model, version=None)
        self.wait()

    def publish(self, model: torch.nn.Module, version: int | None) -> None:
        """Snapshot now (the broadcast of packed buckets starts at once), announce the version
        (trainer 0; None: not announced), and finish the broadcast in the background."""
        self.wait()  # one sync in flight: bounds memory to one extra copy of the shards
        if self.rank == 0 and version is not None:
            assert self.store is not None, "trainer 0 announces versions in the job store"
            index = self.store.add("wsync/count", 0)
            self.store.set(f"wsync/version/{index}", str(version))
            self.store.add("wsync/count", 1)
        self._start_thread()
        self._t0 = time.perf_counter()
        for flat in self.pack(model):
            self._queue.put(flat)
        self._queue.put(None)  # end of this sync

    def _run(self) -> None:
        while True:
            flat = self._queue.get()
            try:
                if flat is None:
                    self.last_broadcast_s = time.perf_counter() - self._t0
                elif self._error is None:
                    broadcast(self.group, flat, root=0)
            except BaseException as e:  # surfaced to the main thread by wait()
                self._error = e
            finally:
                self._queue.task_done()

    def wait(self) -> None:
        """Block until the sync in flight (if any) has been sent."""
        if self._thread is not None:
            self._queue.join()
        if self._error is not None:
            raise RuntimeError(f"weight broadcast failed: {self._error}") from self._error


def pending_broadcasts(store, received: int) -> list[int]:
    """Policy versions of the broadcasts announced after the first `received` ones."""
    count = store.add("wsync/count", 0)
    return [int(store.get(f"wsync/version/{i}")) for i in range(received, count)]


class WeightReceiver:
    """Runs in each generator (vLLM worker) process: receive every sender's buckets, put the
    rows of each tensor back together, hand full tensors to `load`."""

    def __init__(self, metas_by_sender: list[list[TensorMeta]], bucket_mb: int,
                 groups: list[dist.ProcessGroup], device: torch.device):
        assert len(metas_by_sender) == len(groups)
        self.plans = [plan_buckets(m, bucket_mb << 20) for m in metas_by_sender]
        self.groups = groups
        self.device = device
        self.order = [m.name for m in metas_by_sender[0]]  # checkpoint order
        self.full = {m.name: m for ms in metas_by_sender for m in ms}

    def receive(self, load: Callable[[Iterable[tuple[str, torch.Tensor]]], object]) -> int:
        """Receive one full set of weights; returns the number of tensors loaded.

        Every sender's buckets are posted at once; they are awaited round-robin over senders,
        and each tensor is loaded as soon as all its row pieces have arrived, so loading
        overlaps the rest of the transfer."""
        posted = []
        for group, plan in zip(self.groups, self.plans):
            ops = []
            for bucket in plan:
                flat = torch.empty(bucket.numel, dtype=_DTYPES[bucket.dtype], device=self.device)
                opts = dist.BroadcastOptions()
                opts.rootRank, opts.rootTensor = 0, 0
                ops.append((group.broadcast([flat], opts), bucket, flat))
            posted.append(ops)
        expected = {name: 0 for name in self.order}
        for plan in self.plans:
            for bucket in plan:
                for meta, _ in bucket.entries:
                    expected[meta.name] += 1
        pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
        loaded = 0
        for i in range(max(len(ops) for ops in posted)):
            ready = []
            for ops in posted:
                if i < len(ops):
                    work, bucket, flat = ops[i]
                    work.wait()
                    for meta, off in bucket.entries:
                        view = flat[off:off + meta.numel].view(meta.piece_shape)
                        pieces.setdefault(meta.name, []).append((meta.row0, view))
                        if len(pieces[meta.name]) == expected[meta.name]:
                            ready.append(meta.name)
            load(_assembled(ready, pieces))
            loaded += len(ready)
        assert loaded == len(self.order), (loaded, len(self.order))
        return loaded


def _assembled(names: list[str], pieces: dict) -> Iterator[tuple[str, torch.Tensor]]:
    for name in names:
        parts = sorted(pieces.pop(name), key=lambda p: p[0])
        yield name, (parts[0][1] if len(parts) == 1 else torch.cat([p for _, p in parts]))
