"""A RolloutBatch as one flat byte buffer plus a small JSON layout, for any transport.

layout = {column: [dtype name, numel, byte offset]}; columns start 64-byte aligned.
"""

from __future__ import annotations

import torch

from llamarl.buffer.record import RolloutBatch


def plan(batch: RolloutBatch) -> tuple[dict, int]:
    """The layout of `batch` and the total byte size."""
    layout, offset = {}, 0
    for key, t in batch.columns().items():
        layout[key] = [str(t.dtype).removeprefix("torch."), t.numel(), offset]
        offset += (t.numel() * t.element_size() + 63) // 64 * 64
    return layout, max(offset, 1)


def write(batch: RolloutBatch, layout: dict, out: torch.Tensor) -> None:
    """Copy the columns of `batch` into `out` (uint8, at least the planned size)."""
    for key, t in batch.columns().items():
        _, numel, off = layout[key]
        if numel:
            out[off:off + numel * t.element_size()].copy_(t.contiguous().view(torch.uint8))


def pack(batch: RolloutBatch) -> tuple[dict, torch.Tensor]:
    layout, size = plan(batch)
    out = torch.empty(size, dtype=torch.uint8)
    write(batch, layout, out)
    return layout, out


def unpack(layout: dict, buf: torch.Tensor, info: dict) -> RolloutBatch:
    """Columns as views of `buf` (uint8, owned by the caller and never written again): the
    receive's one copy is the one that filled `buf`."""
    cols = {}
    for key, (dtype, numel, off) in layout.items():
        dt = getattr(torch, dtype)
        nbytes = numel * torch.empty((), dtype=dt).element_size()
        cols[key] = buf[off:off + nbytes].view(dt) if numel else torch.empty(0, dtype=dt)
    return RolloutBatch(**cols, info=info)
