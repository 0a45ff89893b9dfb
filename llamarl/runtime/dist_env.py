"""Where this process sits in the job: rank, world, node, and where the job's store lives.

Read from torchrun's environment, or from Slurm's when started by `srun` without torchrun.
Importing this module is cheap (no torch), so the layout is checked before anything heavy loads.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "slurm"
    # the launcher's restart attempt (torchrun --max-restarts, Slurm requeue): namespaces the
    # store keys; a restarted job resumes by itself (runtime/setup.py)
    restart: int = 0

    @property
    def agent_store(self) -> bool:
        """torchrun's agent hosts the store at MASTER_ADDR:MASTER_PORT; every rank is a client.
        Otherwise global rank 0 hosts it there."""
        return self.launcher == "torchrun"


def _first_host(nodelist: str) -> str:
    """First hostname of a Slurm nodelist: 'node[03-05,07],gpu1' -> 'node03'."""
    m = re.match(r"([^\[,]+)(\[([^\]]+)\])?", nodelist)
    if not m:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST {nodelist!r}: set MASTER_ADDR")
    base, _, ranges = m.groups()
    if not ranges:
        return base
    return base + ranges.split(",")[0].split("-")[0]


def from_environ(environ: dict | None = None) -> DistEnv | None:
    """The job position from the environment, or None when not started by a launcher."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "LOCAL_WORLD_SIZE" in env):
        return DistEnv(
            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env["LOCAL_RANK"]), local_world_size=int(env["LOCAL_WORLD_SIZE"]),
            master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]),
            launcher="torchrun" if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "env",
            restart=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = int(env["SLURM_NTASKS"])
        nodes = int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1")))
        if world % nodes:
            raise ValueError(f"SLURM_NTASKS {world} is not a multiple of SLURM_NNODES {nodes}: "
                             "use the same --ntasks-per-node on every node")
        addr = env.get("MASTER_ADDR") or _first_host(env.get("SLURM_JOB_NODELIST", "localhost"))
        port = int(env.get("MASTER_PORT") or 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
        return DistEnv(rank=int(env["SLURM_PROCID"]), world_size=world,
                       local_rank=int(env.get("SLURM_LOCALID", "0")),
                       local_world_size=world // nodes, master_addr=addr, master_port=port,
                       launcher="slurm", restart=int(env.get("SLURM_RESTART_COUNT", "0")))
    return None
