"""The torch.distributed transport (sync.transport: torch, the default): sender r and every
generator rank form the group `wsync<r>` (group rank 0 = the sender, receiver j = rank j).

On gloo (CPU) every bucket goes to each receiver as a point-to-point send, all posted at once
(groups.point_to_point says why); on NCCL (GPU) as one broadcast. Which receivers get a sync
is `Members`' answer: every other member by default, the engines alive when engines can be
lost and replaced (parallel/weight_members.py, which also gives a replacement a group of its
own). A broadcast cannot leave a member out: with one NCCL group a lost engine fails the job.

Pair groups (`spec.options["pairs"]`, sync.weight_groups; runtime.weight_pairs): sender r has a
group with each engine e, `wsync<r>/pair<e>` = [sender, e's tp ranks], and sends every bucket
point to point on each (NCCL's send / recv on GPU); a lost engine's groups can be aborted
without touching the others.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from llamarl.parallel.groups import (
    broadcasts,
    make_group,
    point_to_point,
    post_from_root,
    post_to_all,
)
from llamarl.parallel.transports.base import (
    ReceiverTransport,
    SenderTransport,
    TransportSpec,
    Work,
)


class Members:
    """Who receives a sender's syncs on gloo point to point: (receiver, group, group rank)
    for every receiver, and which receivers are lost. This default: every member of the
    sender's group but itself, none lost (parallel/weight_members.py knows the roster)."""

    def __init__(self, group: Callable[[], dist.ProcessGroup]):
        self.group = group

    def targets(self) -> list[tuple[int, dist.ProcessGroup, int]]:
        group = self.group()
        return [(d, group, d) for d in range(1, group.size())]

    def lost(self) -> set[int]:
        return set()


class PairMembers(Members):
    """Who receives on pair groups: engine e's tp ranks (group ranks 1 .. tp) on pair e."""

    def __init__(self, pairs: list[dist.ProcessGroup], tp: int):
        self.pairs, self.tp = pairs, tp

    def targets(self) -> list[tuple[int, dist.ProcessGroup, int]]:
        return [(e, g, 1 + k) for e, g in enumerate(self.pairs) for k in range(self.tp)]


class Sender(SenderTransport):
    def __init__(self, spec: TransportSpec, group: dist.ProcessGroup | None = None,
                 members: Callable[[Sender], Members] | None = None):
        """`members(self)`: who receives, once the groups are built (parallel/
        weight_members.py, when engines can be lost); by default every member, none lost."""
        super().__init__(spec)
        self.pairs: list[dist.ProcessGroup] = []  # pair groups: one per engine
        if spec.options.get("pairs") and group is None:
            # a rendezvous with each engine in turn; an engine builds its pairs in trainer
            # order, so no two ranks wait for each other
            self.pairs = [make_group(g) for g in spec.groups]
            self.group = None
            self.point_to_point = True
            self.members = (members(self) if members is not None
                            else PairMembers(self.pairs, spec.tp))
        else:
            self.group = group if group is not None else make_group(spec.groups[0])
            self.point_to_point = point_to_point(self.group)
            self.members = (members(self) if members is not None
                            else Members(lambda: self.group))
        self._targets: list[tuple[int, dist.ProcessGroup, int]] = []
        # broadcasts to one tp rank's receivers (NCCL, tp > 1; point to point needs none)
        self.tp_groups = ([] if self.point_to_point else
                          [make_group(g) for g in spec.tp_groups])

    @classmethod
    def over(cls, group: dist.ProcessGroup, members: Members | None = None) -> Sender:
        """A sender on a group built elsewhere (group rank 0 = this sender)."""
        return cls(TransportSpec("torch", 0, 1, group.size() - 1), group,
                   None if members is None else (lambda sender: members))

    def begin(self) -> None:
        self._targets = self.members.targets() if self.point_to_point else []

    def send(self, tensor: torch.Tensor, tag: int,
             to: int | None = None) -> list[tuple[int, Work]]:
        """A receiver whose send cannot even be posted (gloo raises at once when the peer
        has closed its connection) is left out of the rest of this sync; its failure is
        settled by the sender (forgiven once the receiver is declared lost)."""
        if not self.point_to_point:
            group = self.group if to is None else self.tp_groups[to]
            return [(-1, w) for w in post_to_all(group, tensor, tag, False)]
        works = []
        for target in list(self._targets):
            receiver, group, dst = target
            if to is not None and (dst - 1) % self.spec.tp != to:
                continue
            try:
                works.append((receiver, group.send([tensor], dst, tag)))
            except RuntimeError as e:
                self.failures.append((receiver, e))
                self._targets.remove(target)
        return works

    def lost(self) -> set[int]:
        return self.members.lost()


class Receiver(ReceiverTransport):
    def __init__(self, spec: TransportSpec, groups: list[dist.ProcessGroup] | None = None):
        super().__init__(spec)
        self.groups = groups if groups is not None else [make_group(g) for g in spec.groups]
        pairs = bool(spec.options.get("pairs"))
        self._p2p = [pairs or point_to_point(g) for g in self.groups]
        # NCCL, or gloo standing in for it (LLAMARL_GLOO_BROADCAST: the CPU tests of the GPU
        # path, pair groups included)
        nccl = any(g.name() == "nccl" for g in self.groups) or broadcasts("gloo")
        # NCCL: a receive posted early would hold the GPU while the engine generates
        self.posts_early = all(self._p2p) and not nccl
        # several communicators on one GPU (NCCL), or broadcasts: sender by sender (base.py)
        self.ordered = nccl or not all(self._p2p)
        self.tp_groups = ([] if all(self._p2p) else
                          [make_group(g) for g in spec.tp_groups])

    @classmethod
    def over(cls, groups: list[dist.ProcessGroup]) -> Receiver:
        """A receiver on groups built elsewhere (group s: sender s at group rank 0)."""
        return cls(TransportSpec("torch", groups[0].rank(), len(groups), groups[0].size() - 1),
                   groups)

    def receive(self, tensor: torch.Tensor, sender: int, tag: int, own: bool = False) -> Work:
        if own and not self._p2p[sender]:  # NCCL: the broadcast to this tp rank's receivers
            return post_from_root(self.tp_groups[sender], tensor, tag, False)
        return post_from_root(self.groups[sender], tensor, tag, self._p2p[sender])
