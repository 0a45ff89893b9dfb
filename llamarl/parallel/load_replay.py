"""Replaying an engine's `load_weights` as plain tensor copies.

vLLM's `model.load_weights(iterable of (name, tensor))` maps checkpoint tensors onto the
engine's parameters: fused projections (q/k/v -> qkv_proj, gate/up -> gate_up_proj), tensor
parallel slices, vocabulary padding. It does so in Python, tensor by tensor, on every weight
sync (~30 us a tensor on a CPU here: 0.75 ms for the 26 tensors of the tiny model, more than
the broadcast of its 1.2 MB). The mapping is the same on every sync, so it is recorded on the
first one and replayed afterwards:

    record:  run load_weights(received) once under a TorchDispatchMode that sees every aten op,
             and keep each  dst.copy_(src)  where dst is a view of an engine tensor and src a
             view of a received tensor, and each constant fill of an engine tensor
    replay:  torch._foreach_copy_(dsts, srcs) with the same views, whose received storage now
             holds the new weights (receive buffers are reused across syncs)

A load is replayable only if received data reaches the engine through views and `copy_`
alone, nothing else writes engine tensors, no engine tensor's storage is replaced, and the
written regions do not overlap (so the copies may run in any order, e.g. bucket by bucket as
the buckets arrive). Anything else (arithmetic on a received tensor such as a cast or a
quantisation, a copy into a temporary, ...) makes `LoadRecorder.problem` say why, and the
caller keeps calling load_weights. The recorder only watches: every op runs as it would.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_FILLS = (aten.fill_.Scalar, aten.zero_.default)


def storage_id(t: torch.Tensor) -> int | None:
    """Address of the memory behind `t` (shared by all its views); None for empty tensors."""
    if t.numel() == 0:
        return None
    return t.untyped_storage().data_ptr()


class LoadRecorder(TorchDispatchMode):
    """Context manager: records how a load writes received tensors into engine tensors.

    After the `with` block: `copies` = [(dst, src)] (dst a view of an engine tensor, src a
    view of a received tensor, same shape), `fills` = [(dst, value)], and `problem` = None
    if replaying them reproduces the load, else the reason it would not.
    """

    def __init__(self, engine_tensors: list[torch.Tensor], received: list[torch.Tensor]):
        super().__init__()
        self.engine = {storage_id(t) for t in engine_tensors} - {None}
        self.received = {storage_id(t) for t in received} - {None}
        self.watch = [(t, t.data_ptr()) for t in engine_tensors]  # tensor, address
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.fills: list[tuple[torch.Tensor, float]] = []
        self.problem: str | None = None
        self._paused = False

    def add_received(self, t: torch.Tensor) -> None:
        """`t` (made during the load, e.g. rows put together) holds received data too."""
        self.received.add(storage_id(t))

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Ops run here are the caller's own bookkeeping, not part of the load."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._paused and self.problem is None:
            self.problem = self._note(func, args, kwargs)
        return func(*args, **kwargs)

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if self.problem is None and any(t.data_ptr() != p for t, p in self.watch):
            self.problem = "load_weights replaced the storage of an engine tensor"
        if self.problem is None:
            clash = first_overlap([d for d, _ in self.copies] + [d for d, _ in self.fills])
            if clash is not None:
                self.problem = f"load_weights writes overlapping engine regions {clash}"
        if self.problem is None and not self.copies:
            self.problem = "load_weights copied no received tensor into the engine"
        return out

    def _note(self, func, args, kwargs) -> str | None:
        """None if the op is compatible with a replay (recording it if it writes the engine)."""
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            into_engine = storage_id(dst) in self.engine
            from_received = storage_id(src) in self.received
            if into_engine and from_received and dst.shape == src.shape:
                self.copies.append((dst, src))
                return None
            if into_engine or from_received:
                return (f"a copy_ {tuple(src.shape)} -> {tuple(dst.shape)} is not a plain copy "
                        "of received data into an engine tensor")
            return None
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func in _FILLS and storage_id(args[0]) in self.engine:
            self.fills.append((args[0], args[1] if func is aten.fill_.Scalar else 0))
            return None
        if func._schema.is_mutable:
            if any(storage_id(t) in self.engine | self.received for t in tensors):
                return f"{func} writes an engine or a received tensor"
            return None
        if func.is_view:
            return None
        if any(storage_id(t) in self.received for t in tensors):
            return f"{func} computes with a received tensor"
        return None


def first_overlap(views: list[torch.Tensor]) -> tuple | None:
    """Two views whose memory spans (first to last element, in bytes) intersect, as their
    shapes, or None. Spans are conservative: interleaved strided views count as overlapping."""
    spans = []
    for v in views:
        if v.numel() == 0:
            continue
        start = v.storage_offset() * v.element_size()
        last = sum((n - 1) * s for n, s in zip(v.shape, v.stride())) * v.element_size()
        spans.append((storage_id(v), start, start + last + v.element_size(), tuple(v.shape)))
    spans.sort()
    for a, b in zip(spans, spans[1:]):
        if a[0] == b[0] and b[1] < a[2]:
            return a[3], b[3]
    return None


def split_rows(dst: torch.Tensor, src: torch.Tensor, full: torch.Tensor,
               pieces: list[tuple[object, int, torch.Tensor]]
               ) -> list[tuple[object, torch.Tensor, torch.Tensor]] | None:
    """Rewrite `dst.copy_(src)`, src a view of the contiguous tensor `full`, as copies from
    `pieces` = [(key, row0, piece)], piece = rows [row0, row0 + len(piece)) of full held
    elsewhere (e.g. in a receive buffer). Returns [(key, dst part, src part)], or None when
    src does not map its dim 0 onto whole rows of full.

    With L = elements per row of full, o = src's element offset in full, shape z, strides st:
    src index i0 lies in row o // L + i0 exactly when st[0] == L (or z[0] == 1) and one
    index's elements fit in a row: o % L + sum_k>0 (z[k] - 1) st[k] < L. Then rows [p, q) of
    src come from a piece as  piece.as_strided((q - p, *z[1:]), (L, *st[1:]),
    (p - row0) * L + o % L)  and go to  dst.narrow(0, p - o // L, q - p).
    """
    assert full.is_contiguous() and dst.shape == src.shape
    if full.dim() == 0 or src.dim() == 0 or any(s < 0 for s in src.stride()):
        return None
    row = full[0].numel()
    o = src.storage_offset() - full.storage_offset()
    z, st = tuple(src.shape), tuple(src.stride())
    first, within = divmod(o, row)
    if z[0] > 1 and st[0] != row:
        return None
    if within + sum((n - 1) * s for n, s in zip(z[1:], st[1:])) >= row:
        return None
    out = []
    for key, row0, piece in pieces:
        p, q = max(first, row0), min(first + z[0], row0 + piece.shape[0])
        if p < q:
            part = piece.as_strided((q - p,) + z[1:], (row,) + st[1:],
                                    piece.storage_offset() + (p - row0) * row + within)
            out.append((key, dst.narrow(0, p - first, q - p), part))
    return out
