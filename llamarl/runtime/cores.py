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

Handing the cores over also needs the rank that stops to let go of them at once. An OpenMP
thread that has finished its share spins before it sleeps: GNU OpenMP (torch's CPU wheels) for
300,000 rounds, 8.5 ms of a core on the 2-core CPU after every parallel operation, Intel's for
KMP_BLOCKTIME = 200 ms. Right after the update the trainer's worker thread spun on a core while
the engines received the new weights and started sampling: the 90th percentile of the second
engine's weight load was 12-60 ms in four runs of the 2-engine recipe (4-8 ms with the spin
below), which starts its sampling that much late, and the trainer's sync took 7-11 ms (2-3 ms;
docs/measured.md). `release_cores_promptly` sets a spin of about 1 ms (GOMP_SPINCOUNT=30000,
KMP_BLOCKTIME=1) for every rank, before torch loads the OpenMP runtime (which reads them once);
a value the user set is kept. About 1 ms still keeps the worker awake between the update's
operations: shorter (1000 rounds, 0.1 ms) made the tiny update ~18% slower, 1 ms matched the
default. The whole step did not measurably change: 0.99x over 12 pairs of 45-step runs taken in
both orders (each order alone 1.04x and 0.95x: the machine's drift is larger than the few ms
gained).
"""

from __future__ import annotations

import os

from llamarl.config import Config
from llamarl.runtime.layout import Layout

# How long an idle OpenMP thread spins before it sleeps (see the module docstring)
SPIN_ENV = {"GOMP_SPINCOUNT": "30000", "KMP_BLOCKTIME": "1"}


def release_cores_promptly() -> None:
    """Idle OpenMP threads sleep after ~1 ms of spinning instead of 8.5-200 ms (module
    docstring); a value already in the environment is kept. Call before torch is imported."""
    for key, value in SPIN_ENV.items():
        os.environ.setdefault(key, value)


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
