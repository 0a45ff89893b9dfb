"""Moving a micro-batch's tensors to the trainer's device."""

from __future__ import annotations

import torch


def tensor_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`. A CPU tensor bound for a GPU goes through pinned memory without
    blocking: a copy from pageable memory makes the host wait until the device has run
    everything queued before it, so each micro-batch's inputs drained the GPU's queue while
    the host had the whole forward still to launch."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
