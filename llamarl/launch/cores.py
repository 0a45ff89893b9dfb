"""CPU threads per rank: which role gets the host's cores, and when.

torchrun starts every rank with OMP_NUM_THREADS=1. On a CPU host that wastes the machine
whenever one role waits for the other, which is always the case on-policy:

    max_staleness = 0:  generate | train | generate | train ...   the roles alternate, so the
                        role that runs gets every core of the host: each of the host's engine
                        ranks cores / engine ranks here, each trainer rank cores / trainer
                        ranks here (a waiting rank blocks in a store or gloo wait: no CPU).
    max_staleness >= 1: generation overlaps training, so every local rank gets an equal
                        share: cores / local ranks (at least 1).

`trainer.threads` and `generator.threads` (> 0) override the choice for a role. GPU ranks are
left alone (their work is on the device).
"""

from __future__ import annotations

import os

from llamarl.config import Config
from llamarl.launch.layout import Layout


def host_cores() -> int:
    """Cores this process may run on (the affinity mask: a Slurm or cgroup CPU limit)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def local_ranks(layout: Layout, rank: int, role: str | None = None) -> int:
    """Ranks of `role` (None: of any role) on the node of global rank `rank`."""
    node = layout.node_of(rank)
    return sum(1 for r in range(layout.world_size)
               if layout.node_of(r) == node and role in (None, layout.role_of(r).role))


def threads_for(cfg: Config, layout: Layout, rank: int, cores: int | None = None) -> int:
    """Threads for global rank `rank` on CPU (see the module docstring)."""
    role = layout.role_of(rank).role
    explicit = cfg.trainer.threads if role == "trainer" else cfg.generator.threads
    if explicit:
        return explicit
    cores = host_cores() if cores is None else cores
    if cfg.sync.max_staleness == 0:
        return max(1, cores // local_ranks(layout, rank, role))
    return max(1, cores // local_ranks(layout, rank))
