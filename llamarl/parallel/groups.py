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
import threading
import time
from collections.abc import Callable
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


def job_group_spec(rt, name: str, rank: int, size: int,
                   backend: str | None = None) -> GroupSpec:
    """Group `name` of the running job (a runtime.setup.Runtime) on its store, under the
    job's prefix, on this rank's backend (or `backend`); this process is group rank `rank`
    of `size`."""
    return GroupSpec(rt.env.master_addr, rt.env.master_port, f"{rt.prefix}/{name}", rank, size,
                     backend or default_backend(rt.device), rt.cfg.sync.timeout_s)


def planned_spec(rt, group, global_rank: int | None = None) -> GroupSpec:
    """The GroupSpec of a planned group (parallel/plan.py: PlannedGroup) for the member of
    global rank `global_rank` (this rank by default)."""
    me = rt.role.rank if global_rank is None else global_rank
    return job_group_spec(rt, group.name, group.rank_of(me), len(group.ranks))


# Set to 1, gloo groups are built at their first operation, as NCCL makes a communicator
# (ProcessGroupNCCL without a bound device): the CPU tests run NCCL's start-up semantics with
# it (a peer lost before the first operation leaves that operation waiting), which plain gloo,
# connected in its constructor, cannot show. make_group connects every group before it returns
# (connect), so no operation of the job ever is a group's first.
LAZY_GROUPS_ENV = "LLAMARL_LAZY_GROUPS"
GIVE_UP_POLL_S = 0.05  # how often a group being made asks whether its peer is gone
# how long a group that failed to be made (a peer died in the rendezvous: gloo's connect is
# refused) still asks whether the peer is gone before raising: the watchdogs see a dead peer
# within a few heartbeats (runtime/watchdog.py: STALE_S), a loaded machine many times that
GIVE_UP_GRACE_S = 60.0


def make_group(spec: GroupSpec, store: dist.Store | None = None,
               give_up: Callable[[], bool] | None = None) -> dist.ProcessGroup | None:
    """Construct the process group described by `spec` and its communicator (a collective:
    all members must call; they meet on the store). Returns once every member has; NCCL's
    communicator is made here too (`connect`), not at the group's first operation, so a
    member lost before that operation cannot leave another waiting in it.

    `give_up()`: asked every GIVE_UP_POLL_S while the members are not all there (the group is
    then made on a thread of its own); True gives up the group (a peer is gone for good, e.g.
    a replacement engine lost before it was back): None is returned, and the thread, waiting
    in the store or in NCCL's bootstrap, ends with sync.timeout_s. A make that fails (a peer
    died halfway through the rendezvous) keeps asking for GIVE_UP_GRACE_S before it raises:
    the peer's death is declared by the watchdogs a moment after the connection is refused.
    Without `give_up` a lost peer ends this process through the watchdog
    (runtime/watchdog.py)."""
    if give_up is None:
        return _connected(spec, store)
    made: list = []
    failed: list[BaseException] = []

    def build() -> None:
        try:
            made.append(_connected(spec, store))
        except BaseException as e:  # noqa: BLE001 - re-raised below unless given up
            failed.append(e)

    thread = threading.Thread(target=build, daemon=True, name=f"llamarl-group-{spec.prefix}")
    thread.start()
    while thread.is_alive():
        thread.join(GIVE_UP_POLL_S)
        if thread.is_alive() and give_up():
            return None
    if failed:
        deadline = time.monotonic() + GIVE_UP_GRACE_S
        while time.monotonic() < deadline:
            if give_up():
                return None
            time.sleep(GIVE_UP_POLL_S)
        raise failed[0]
    return made[0]


def _connected(spec: GroupSpec, store: dist.Store | None) -> dist.ProcessGroup:
    if store is None:
        store = connect_store(spec.host, spec.port, spec.timeout_s)
    prefixed = dist.PrefixStore(spec.prefix, store)
    timeout = timedelta(seconds=spec.timeout_s)
    if spec.backend == "gloo":
        if os.environ.get(LAZY_GROUPS_ENV) == "1":
            group = LazyGlooGroup(prefixed, spec.rank, spec.size, timeout)
        else:
            return dist.ProcessGroupGloo(prefixed, spec.rank, spec.size, timeout)
    elif spec.backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, spec.rank, spec.size, opts)
    else:
        raise ValueError(f"backend {spec.backend!r}: use gloo or nccl")
    connect(group)
    return group


def connect(group) -> None:
    """Make `group`'s communicator now: one broadcast of one element from group rank 0, which
    every member runs (NCCL creates a communicator at a group's first operation; gloo, built
    connected, just meets)."""
    device = (torch.device("cuda", torch.cuda.current_device()) if group.name() == "nccl"
              else torch.device("cpu"))
    _broadcast(group, torch.zeros(1, device=device), 0).wait()


class LazyGlooGroup:
    """A gloo group built at its first operation (LAZY_GROUPS_ENV): the members meet then, as
    NCCL's members do when its communicator is made. Knows its rank and size before."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta):
        self._args = (store, rank, size, timeout)
        self._group: dist.ProcessGroupGloo | None = None
        self._lock = threading.Lock()

    def name(self) -> str:
        return "gloo"

    def rank(self) -> int:
        return self._args[1]

    def size(self) -> int:
        return self._args[2]

    def __getattr__(self, attr: str):  # send, recv, broadcast, ...: on the group, built now
        with self._lock:
            if self._group is None:
                self._group = dist.ProcessGroupGloo(*self._args)
        return getattr(self._group, attr)


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
    return group.name() == "gloo" and not broadcasts("gloo")


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
