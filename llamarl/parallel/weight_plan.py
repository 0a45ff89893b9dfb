"""The plan of a weight sync: what each trainer rank sends, and how it is packed into messages.

FSDP2 shards each parameter along dim 0 over the T trainer ranks; trainer rank r sends its own
rows of every sharded tensor, and trainer 0 the replicated ones whole (`local_pieces`). Each
piece is described by a `TensorMeta` (name, dtype, full shape, its rows), which every sender
publishes once, so a receiver knows what arrives before it arrives. The pieces are packed into
`Bucket`s, one message each: one dtype per bucket, at most sync.bucket_mb, and a piece of at
least sync.solo_mb in a message of its own (`plan_buckets`). Sender and receiver compute the
same plan from the same metas: bucket b of sender r is message b (its tag) from r.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

# The dtypes a piece may travel as, by their str() in a TensorMeta.
DTYPES_BY_NAME = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
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
        return math.prod(self.piece_shape)


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
        size = itemsize(dtype)
        cap = max(1, bucket_bytes // size)
        solo = max(1, min(bucket_bytes, solo_bytes) // size)
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


def model_tensors(model: torch.nn.Module, buffers: set[str] | None = None,
                  adapters: bool = False) -> dict[str, torch.Tensor]:
    """Parameters (tied ones once) and persistent buffers, by their checkpoint names: the
    tensors the engines load. A LoRA policy's (trainer/lora.py) go by the base model's names
    and without the adapters: `...q_proj.base_layer.weight` as `...q_proj.weight`, whose
    value on the wire is the merged W + s B A (WeightSender reads it from lora.merged_shard;
    same shape and rows as W). With `adapters` (model.lora.sync adapters) the adapters
    alone, A [r, in] and B [out, r] of each adapted linear, by their names in PEFT's saved
    form (lora.adapter_name), which vLLM's LoRA loader reads: the engines hold the base
    weights from the checkpoint. A module_to_save (model.lora.modules_to_save) goes by the
    base name with its trained copy's value, its frozen original left out."""
    from llamarl.parallel.adapters import adapter_name, engine_name, is_adapter, sent_in_full

    if adapters:
        return {adapter_name(n): p for n, p in model.named_parameters() if is_adapter(n)}
    out = {engine_name(n): p for n, p in model.named_parameters() if sent_in_full(n)}
    if buffers is None:
        buffers = persistent_buffer_names(model)
    for name, buf in model.named_buffers():
        if name in buffers:
            out[engine_name(name)] = buf
    return out


def local_pieces(model: torch.nn.Module, rank: int, buffers: set[str],
                 wire_dtype: torch.dtype | None = None, adapters: bool = False,
                 ) -> list[tuple[TensorMeta, torch.Tensor | None]]:
    """What trainer `rank` sends: its dim-0 shard of each FSDP2 (Shard(0)) parameter, and whole
    replicated tensors on rank 0 only (None = nothing from this rank). Floating-point tensors
    travel as `wire_dtype` when given (the engines' dtype: float32 master weights are sent as
    bfloat16, cast while packing, at half the bytes). `adapters`: a LoRA policy's adapters
    alone (model_tensors), each rank its rows of A and B, which the receiver puts together."""
    from torch.distributed.tensor import DTensor, Shard

    out = []
    for name, t in model_tensors(model, buffers, adapters).items():
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


def itemsize(dtype: str) -> int:
    """Bytes per element of a TensorMeta/Bucket dtype."""
    return torch.empty((), dtype=DTYPES_BY_NAME[dtype]).element_size()


# -- resharded syncs (tp > 1 engines) --------------------------------------------------------
# A tensor-parallel engine's rank reads only part of most tensors (vLLM's load_weights keeps
# its rows of a column-parallel weight, its columns of a row-parallel one, its share of the
# vocabulary). `Needs` says which part, as one block per tensor: [start, stop) per dim of the
# full tensor, found on the first sync (weight_receiver: the copies load_weights made). From
# the second sync on, each sender sends each tp rank only its block of the rows it holds.
Needs = dict[str, list[list[int]]]


@dataclass(frozen=True)
class SliceMeta:
    """Block `block` ([start, stop) per dim, in the coordinates of the sender's piece) of the
    piece `piece` that one sender holds; packed like a TensorMeta (plan_buckets)."""

    piece: TensorMeta
    block: tuple[tuple[int, int], ...]

    @property
    def name(self) -> str:
        return self.piece.name

    @property
    def dtype(self) -> str:
        return self.piece.dtype

    @property
    def piece_shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.block)

    @property
    def numel(self) -> int:
        return math.prod(self.piece_shape)

    def of(self, piece: torch.Tensor) -> torch.Tensor:
        """This block of `piece` (a view: the sender's local rows, or the receiver's copy)."""
        return piece[tuple(slice(a, b) for a, b in self.block)] if self.block else piece


def slice_plan(metas: list[TensorMeta], needs: Needs) -> list[SliceMeta]:
    """What one sender (its pieces `metas`) sends to a tp rank that reads `needs`: the block
    of each piece that overlaps it, in the metas' order; tensors it does not read, nothing."""
    out = []
    for m in metas:
        if m.name not in needs or not m.numel:
            continue
        need = needs[m.name]
        if not m.shape:
            out.append(SliceMeta(m, ()))
            continue
        lo, hi = max(need[0][0], m.row0), min(need[0][1], m.row0 + m.local_rows)
        if lo >= hi:
            continue
        block = ((lo - m.row0, hi - m.row0),) + tuple((a, b) for a, b in need[1:])
        out.append(SliceMeta(m, block))
    return out


def block_in(view: torch.Tensor, base: torch.Tensor) -> list[list[int]] | None:
    """The block ([start, stop) per dim of `base`) that `view` is, when it is one: a view of
    the contiguous `base` with base's strides in every dim it spans; else None."""
    if view.dim() != base.dim() or not base.is_contiguous():
        return None
    if not base.dim():
        return []
    o = view.storage_offset() - base.storage_offset()
    if o < 0 or o >= base.numel():
        return None
    out = []
    for size, stride, full, want in zip(view.shape, view.stride(), base.shape, base.stride()):
        start, o = divmod(o, want)
        if (size > 1 and stride != want) or start + size > full:
            return None
        out.append([start, start + size])
    return out


def merge_blocks(a: list[list[int]] | None, b: list[list[int]]) -> list[list[int]]:
    """The smallest block holding blocks a (None: nothing yet) and b."""
    if a is None:
        return [list(r) for r in b]
    return [[min(x[0], y[0]), max(x[1], y[1])] for x, y in zip(a, b)]
