"""The torch.distributed transport (sync.transport: torch, the default): sender r and every
generator rank form the group `wsync<r>` (group rank 0 = the sender, receiver j = rank j).

On gloo (CPU) every bucket goes to each receiver as a point-to-point send, all posted at once
(groups.point_to_point says why); on NCCL (GPU) as one broadcast. Which receivers get a sync
is `Members`' answer: every other member by default, the engines alive when engines can be
lost and replaced (trainer/weight_members.py, which also gives a replacement a two-rank group
of its own). A broadcast cannot leave a member out: with NCCL a lost engine fails the job.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from llamarl.parallel.groups import make_group, point_to_point, post_from_root, post_to_all
from llamarl.parallel.transports.base import (
    ReceiverTransport,
    SenderTransport,
    TransportSpec,
    Work,
)


class Members:
    """Who receives a sender's syncs on gloo point to point: (receiver, group, group rank)
    for every receiver, and which receivers are lost. This default: every member of the
    sender's group but itself, none lost (trainer/weight_members.py knows the roster)."""

    def __init__(self, group: Callable[[], dist.ProcessGroup]):
        self.group = group

    def targets(self) -> list[tuple[int, dist.ProcessGroup, int]]:
        group = self.group()
        return [(d, group, d) for d in range(1, group.size())]

    def lost(self) -> set[int]:
        return set()


class Sender(SenderTransport):
    def __init__(self, spec: TransportSpec, group: dist.ProcessGroup | None = None,
                 members: Members | None = None):
        super().__init__(spec)
        self.group = group if group is not None else make_group(spec.groups[0])
        self.point_to_point = point_to_point(self.group)
        self.members = members or Members(lambda: self.group)
        self._targets: list[tuple[int, dist.ProcessGroup, int]] = []
        # broadcasts to one tp rank's receivers (NCCL, tp > 1; point to point needs none)
        self.tp_groups = ([] if self.point_to_point else
                          [make_group(g) for g in spec.tp_groups])

    @classmethod
    def over(cls, group: dist.ProcessGroup, members: Members | None = None) -> Sender:
        """A sender on a group built elsewhere (group rank 0 = this sender)."""
        return cls(TransportSpec("torch", 0, 1, group.size() - 1), group, members)

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
        self._p2p = [point_to_point(g) for g in self.groups]
        # NCCL: a broadcast posted early would hold the GPU while the engine generates
        self.posts_early = all(self._p2p)
        self.ordered = not all(self._p2p)  # broadcasts: sender by sender (base.py)
        self.tp_groups = [] if self.posts_early else [make_group(g) for g in spec.tp_groups]

    @classmethod
    def over(cls, groups: list[dist.ProcessGroup]) -> Receiver:
        """A receiver on groups built elsewhere (group s: sender s at group rank 0)."""
        return cls(TransportSpec("torch", groups[0].rank(), len(groups), groups[0].size() - 1),
                   groups)

    def receive(self, tensor: torch.Tensor, sender: int, tag: int, own: bool = False) -> Work:
        if own and not self._p2p[sender]:  # NCCL: the broadcast to this tp rank's receivers
            return post_from_root(self.tp_groups[sender], tensor, tag, False)
        return post_from_root(self.groups[sender], tensor, tag, self._p2p[sender])
