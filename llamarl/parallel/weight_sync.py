"""Trainer -> generator weight broadcast in flat per-dtype buckets.

Both sides derive the same `BucketPlan` from the tensor metadata (name, dtype, shape) that the
trainer publishes once. One sync then is, for each bucket in plan order:

    trainer ranks: unshard one FSDP2 unit at a time (one all-gather per block, in lockstep)
    sender:        flat[off_i : off_i + n_i] = t_i ; broadcast(flat, root=0)
    receivers:     broadcast(flat) ; load_weights([(name_i, flat[off_i:off_i + n_i].view(shape_i))])

so a model of P tensors costs ceil(bytes / bucket_bytes) messages, not P.

Versions: the trainer announces broadcast i in the store (`wsync/count` = i + 1,
`wsync/version/<i>` = policy version) before sending it, so a generator can see between two
generation batches that weights are waiting, and receive every broadcast in order. The sender
snapshots the weights into flat buffers (the lockstep gather) and broadcasts them from a
background thread: the trainer never waits for a generator that is busy finishing a batch.
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
    name: str
    dtype: str  # e.g. "torch.float32"
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Bucket:
    dtype: str
    entries: tuple[tuple[TensorMeta, int], ...]  # (meta, element offset in the flat buffer)
    numel: int


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Group tensors by dtype (first-seen order), then pack each group into buckets of at most
    `bucket_bytes` (a larger tensor gets a bucket of its own)."""
    by_dtype: dict[str, list[TensorMeta]] = {}
    for m in metas:
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
    return json.dumps([[m.name, m.dtype, list(m.shape)] for m in metas])


def metas_from_json(text: str) -> list[TensorMeta]:
    return [TensorMeta(n, d, tuple(s)) for n, d, s in json.loads(text)]


def persistent_buffer_names(model: torch.nn.Module) -> set[str]:
    """Buffers that belong in a checkpoint (not e.g. rotary caches). Calls state_dict(), so
    never while an FSDP2 unit is unsharded."""
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


def tensor_metas(tensors: dict[str, torch.Tensor]) -> list[TensorMeta]:
    """Metadata of the full (unsharded) tensors; DTensor.shape is already the global shape."""
    return [TensorMeta(n, str(t.dtype), tuple(t.shape)) for n, t in tensors.items()]


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach()


class WeightSender:
    """Runs on every trainer rank; only the rank with `group` set sends.

    All trainer ranks must call `send` / `publish` together: gathering an FSDP2 shard is a
    collective. `send` broadcasts inline; `publish` gathers inline and broadcasts from a
    background thread (one broadcast in flight at a time).
    """

    def __init__(self, model: torch.nn.Module, bucket_mb: int,
                 group: dist.ProcessGroup | None, device: torch.device, store=None):
        self.buffers = persistent_buffer_names(model)
        self.metas = tensor_metas(model_tensors(model, self.buffers))
        self.buckets = plan_buckets(self.metas, bucket_mb << 20)
        self.group = group
        self.device = device
        self.store = store  # announces broadcasts (needed by `publish`)
        self.bytes_per_sync = sum(b.numel * torch.empty((), dtype=_DTYPES[b.dtype]).element_size()
                                  for b in self.buckets)
        self.sent = 0  # broadcasts completed
        self.last_broadcast_s = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def gather(self, model: torch.nn.Module) -> list[torch.Tensor] | None:
        """Full weights as flat per-bucket tensors on the sender, None elsewhere (collective).

        FSDP2 units are unsharded one at a time (a single all-gather per block, far cheaper
        than one per parameter), copied out, and resharded, so the extra memory is one block
        plus the flat buffers on the sender."""
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        flats = None
        if self.group is not None:
            flats = [torch.empty(b.numel, dtype=_DTYPES[b.dtype], device=self.device)
                     for b in self.buckets]
        where = {meta.name: (i, off, meta.numel) for i, b in enumerate(self.buckets)
                 for meta, off in b.entries}
        done: set[str] = set()

        def copy_full_tensors() -> None:
            for name, t in model_tensors(model, self.buffers).items():
                if name in done or isinstance(t, DTensor):
                    continue
                done.add(name)
                if flats is not None:
                    i, off, n = where[name]
                    flats[i][off:off + n].copy_(t.detach().reshape(-1))

        for unit in [m for m in model.modules() if isinstance(m, FSDPModule)]:
            unit.unshard()  # collective: same order on every trainer rank
            copy_full_tensors()
            unit.reshard()
        copy_full_tensors()  # a model without FSDP2
        for name, t in model_tensors(model, self.buffers).items():  # still sharded: per tensor
            if name not in done:
                done.add(name)
                full = _full(t)
                if flats is not None:
                    i, off, n = where[name]
                    flats[i][off:off + n].copy_(full.reshape(-1))
        return flats

    def _broadcast(self, flats: list[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        for flat in flats:
            broadcast(self.group, flat, root=0)
        self.last_broadcast_s = time.perf_counter() - t0
        self.sent += 1

    def send(self, model: torch.nn.Module) -> None:
        flats = self.gather(model)
        if flats is not None:
            self._broadcast(flats)

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Gather now (all trainer ranks), announce and broadcast in the background."""
        self.wait()  # one snapshot in flight: bounds memory to one extra copy of the weights
        flats = self.gather(model)
        if flats is None:
            return
        assert self.store is not None, "publish needs the job store to announce versions"
        index = self.store.add("wsync/count", 0)
        self.store.set(f"wsync/version/{index}", str(version))
        self.store.add("wsync/count", 1)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="llamarl-wsync", daemon=True)
            self._thread.start()
        self._queue.put(flats)

    def _run(self) -> None:
        while True:
            flats = self._queue.get()
            try:
                if flats is not None:
                    self._broadcast(flats)
            except BaseException as e:  # surfaced to the main thread by wait()
                self._error = e
            finally:
                self._queue.task_done()
            if flats is None:
                return

    def wait(self) -> None:
        """Block until the broadcast in flight (if any) has completed."""
        if self._thread is not None:
            self._queue.join()
        if self._error is not None:
            raise RuntimeError(f"weight broadcast failed: {self._error}") from self._error


def pending_broadcasts(store, received: int) -> list[int]:
    """Policy versions of the broadcasts announced after the first `received` ones."""
    count = store.add("wsync/count", 0)
    return [int(store.get(f"wsync/version/{i}")) for i in range(received, count)]


class WeightReceiver:
    """Runs in each generator (vLLM worker) process: receive buckets, hand them to `load`."""

    def __init__(self, metas: list[TensorMeta], bucket_mb: int, group: dist.ProcessGroup,
                 device: torch.device):
        self.buckets = plan_buckets(metas, bucket_mb << 20)
        self.group = group
        self.device = device

    def receive(self, load: Callable[[Iterable[tuple[str, torch.Tensor]]], object]) -> int:
        """Receive one full set of weights; returns the number of tensors loaded."""
        n = 0
        for bucket in self.buckets:
            flat = torch.empty(bucket.numel, dtype=_DTYPES[bucket.dtype], device=self.device)
            broadcast(self.group, flat, root=0)
            load(_views(bucket, flat))
            n += len(bucket.entries)
        return n


def _views(bucket: Bucket, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    for meta, off in bucket.entries:
        yield meta.name, flat[off:off + meta.numel].view(meta.shape)
