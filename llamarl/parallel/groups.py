"""Cross-role process groups, built directly on a shared TCPStore (see DESIGN.md).

vLLM builds its own torch.distributed world inside an engine, so a generator process never joins a
world-wide default process group. Every group that spans roles (weight broadcast, control) is
constructed here from the job's TCPStore under its own prefix, which works the same in the trainer,
in an in-process vLLM worker, and in a vLLM worker child process (which reconnects from a
`GroupSpec`, a small picklable description).

Backends: NCCL for GPU tensors, gloo on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GroupSpec:
    """Everything a process needs to join a cross-role group; picklable across processes."""

    host: str
    port: int
    prefix: str  # store namespace of this group, e.g. "llamarl/0/wsync"
    rank: int
    size: int
    backend: str  # "gloo" | "nccl"
    timeout_s: float


def connect_store(host: str, port: int, timeout_s: float,
                  is_master: bool = False, world_size: int | None = None) -> dist.TCPStore:
    """A TCPStore handle: the server when `is_master`, else a client of host:port."""
    return dist.TCPStore(host, port, world_size, is_master,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def make_group(spec: GroupSpec, store: dist.Store | None = None) -> dist.ProcessGroup:
    """Construct the process group described by `spec` (a collective: all members must call)."""
    if store is None:
        store = connect_store(spec.host, spec.port, spec.timeout_s)
    prefixed = dist.PrefixStore(spec.prefix, store)
    timeout = timedelta(seconds=spec.timeout_s)
    if spec.backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, spec.rank, spec.size, timeout)
    if spec.backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, spec.rank, spec.size, opts)
    raise ValueError(f"backend {spec.backend!r}: use gloo or nccl")


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, root: int) -> None:
    """Blocking broadcast of `tensor` (in place on receivers) from group rank `root`."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    group.broadcast([tensor], opts).wait()
