"""Cross-role process groups, built directly on a shared TCPStore (docs/architecture.md,
docs/generator.md).

vLLM builds its own torch.distributed world inside an engine, so a generator process never joins a
world-wide default process group. Every group that spans roles (weight broadcast, control) is
constructed here from the job's TCPStore under its own prefix, which works the same in the trainer,
in an in-process vLLM worker, and in a vLLM worker child process (which reconnects from a
`GroupSpec`, a small picklable description).

Backends: NCCL for GPU tensors, gloo on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from llamarl.runtime.job_store import connect_store


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


def job_group_spec(rt, name: str, rank: int, size: int) -> GroupSpec:
    """Group `name` of the running job (a runtime.setup.Runtime) on its store, under the
    job's prefix, on this rank's backend; this process is group rank `rank` of `size`."""
    return GroupSpec(rt.env.master_addr, rt.env.master_port, f"{rt.prefix}/{name}", rank, size,
                     default_backend(rt.device), rt.cfg.sync.timeout_s)


def planned_spec(rt, group, global_rank: int | None = None) -> GroupSpec:
    """The GroupSpec of a planned group (parallel/plan.py: PlannedGroup) for the member of
    global rank `global_rank` (this rank by default)."""
    me = rt.role.rank if global_rank is None else global_rank
    return job_group_spec(rt, group.name, group.rank_of(me), len(group.ranks))


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


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, root: int) -> dist.Work:
    """Post a broadcast of `tensor` (in place on receivers) from group rank `root`."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = root, 0
    return group.broadcast([tensor], opts)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, root: int) -> None:
    """Blocking broadcast of `tensor` (in place on receivers) from group rank `root`."""
    _broadcast(group, tensor, root).wait()


# Set to 1, gloo groups carry weight syncs as broadcasts, exactly as NCCL groups do (the
# receivers' sender-by-sender order, the per-tp-rank broadcast groups): the tests run NCCL's
# code paths on the CPU with it (tests/test_weight_sync.py).
GLOO_BROADCAST_ENV = "LLAMARL_GLOO_BROADCAST"


def broadcasts(backend: str) -> bool:
    """Whether weight syncs on groups of `backend` travel as broadcasts (NCCL) rather than
    as point-to-point messages (gloo; see point_to_point)."""
    return backend == "nccl" or os.environ.get(GLOO_BROADCAST_ENV) == "1"


def point_to_point(group: dist.ProcessGroup) -> bool:
    """Whether the root of `group` sends its messages to every other member as
    point-to-point sends (all posted at once) rather than as broadcasts: on gloo.

    Gloo runs a group's broadcasts on its worker threads (2 by default), each start to finish: two
    messages are in flight at a time, and each is handed to a worker thread at both ends and waits
    for a rendezvous before its bytes move. Its send and recv go straight to the transport from the
    calling thread, so every message of a sync is posted, and matched, at once. On the 2-core CPU
    machine (bench/weight_sync.py) that took a 110M-parameter sync of 86 messages per sender from
    0.14 to 0.11 s, and the tiny model's (one message per sender) from 0.54-0.64x to 0.59-0.62x of a
    raw broadcast (paired runs): fewer thread handoffs is less CPU, and on a CPU the transfer itself
    is CPU work. (A send posted after its receive writes from the caller's thread, so the tiny
    model's publish takes ~0.3 ms longer.) NCCL enqueues broadcasts on its stream without a thread
    handoff, and with several engines its ring or tree beats the root sending each a copy."""
    return isinstance(group, dist.ProcessGroupGloo) and not broadcasts("gloo")


def post_to_all(group: dist.ProcessGroup, tensor: torch.Tensor, tag: int,
                p2p: bool) -> list[dist.Work]:
    """Root (group rank 0) side: send `tensor` to every other member of `group`, without
    waiting; returns the pending works. With `p2p` (see point_to_point) as gloo sends, `tag`
    telling the messages of one sync apart; else as one broadcast."""
    if p2p:
        return [group.send([tensor], dst, tag) for dst in range(1, group.size())]
    return [_broadcast(group, tensor, 0)]


def post_from_root(group: dist.ProcessGroup, tensor: torch.Tensor, tag: int,
                   p2p: bool) -> dist.Work:
    """Receiver side of `post_to_all` (same `tag` and `p2p`): receive into `tensor`."""
    if p2p:
        return group.recv([tensor], 0, tag)
    return _broadcast(group, tensor, 0)
