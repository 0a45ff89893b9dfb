"""`python -m llamarl.launch --join RUN_DIR [key=value ...]`: start a replacement for a lost
engine of a running job (runtime/roster.py).

The run directory says where the job's store is (`store.json`), its recipe and its layout. The
replacement claims the first lost engine nobody replaces yet (a supervisor's replacement:
its own engine, `LLAMARL_JOIN_ENGINE`, launch/supervisor.py) and takes its global rank: the
watchdogs of the other ranks watch that rank again once this process deletes its `done/<rank>`
mark. It then starts its engine, receives the trainers' weights from the sync trainer 0 picks
for it (parallel/weight_members.py), rejoins the roster and takes its slot back from the engine
that made it meanwhile, at that engine's next batch boundary (generator/slots.py).

An engine of generator.tp > 1 is replaced whole: this process becomes its tp rank 0 and starts
its other tp ranks as child processes on this host (`spawn_tp_ranks`: the same command, told
which engine, incarnation and tp rank they are through the environment), which build a new
private world and command stream with it.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from llamarl.config import Config, load_config
from llamarl.runtime.dist_env import DistEnv
from llamarl.runtime.job_store import connect_store, job_prefix
from llamarl.runtime.layout import Layout, compute_layout
from llamarl.runtime.roster import Roster

# set for the other tp ranks of a replacement (spawn_tp_ranks): "<engine>:<incarnation>:<tp rank>"
TP_RANK_ENV = "LLAMARL_JOIN_TP_RANK"
_PR_SET_PDEATHSIG = 1
ENGINE_ENV = "LLAMARL_JOIN_ENGINE"  # the engine to replace (its supervisor's), else any lost


def plan_join(run_dir: str, overrides: list[str]) -> tuple[Config, Layout, DistEnv, str]:
    """The recipe, layout and place in the job of a replacement engine (its tp rank 0, or
    the tp rank that TP_RANK_ENV names), and its incarnation (claimed in the store, so two
    replacements never take the same engine)."""
    root = Path(run_dir)
    if not (root / "store.json").is_file():
        raise ValueError(f"--join {run_dir}: not a run directory of a running job (no "
                         "store.json): give the directory the job prints as 'run directory:'")
    where = json.loads((root / "store.json").read_text())
    shape = json.loads((root / "layout.json").read_text())
    cfg = load_config(str(root / "recipe.yaml"), overrides)
    layout = compute_layout(shape["world_size"], shape["ranks_per_node"], shape["trainer_ranks"],
                            shape["engines"], shape["tp"])
    try:
        raw = connect_store(where["addr"], where["port"], 15.0)
    except Exception as e:  # noqa: BLE001 - one line
        raise ValueError(f"--join {run_dir}: cannot reach the job's store at {where['addr']}:"
                         f"{where['port']} ({type(e).__name__}): is the job still running, and "
                         "is this host able to reach it?") from None
    store = dist.PrefixStore(job_prefix(where["restart"]), raw)
    if os.environ.get(TP_RANK_ENV):  # a tp rank of a replacement its tp rank 0 started
        e, incarnation, k = os.environ[TP_RANK_ENV].split(":")
        engine, tp_rank = int(e), int(k)
    else:
        lost = Roster(store, layout.engines).read().lost
        if os.environ.get(ENGINE_ENV):  # a supervisor replaces the engine of its own rank
            lost = [e for e in lost if e == int(os.environ[ENGINE_ENV])]
        incarnation, tp_rank = secrets.token_hex(3), 0
        engine = next((e for e in lost if store.compare_set(
            f"join/{e}/claimed", "", incarnation).decode() == incarnation), None)
        if engine is None:
            raise ValueError(f"--join {run_dir}: no engine of this job is lost (or each lost "
                             f"one is being replaced already): nothing to replace")
    rank = layout.engine_global_ranks(engine)[tp_rank]
    # the store checks that it is this job's (runtime/job_store.py): be that job
    job, _, step = where["job"].partition(".")
    for key, value in (("SLURM_JOB_ID", job), ("SLURM_STEP_ID", step)):
        if value:
            os.environ[key] = value
        else:
            os.environ.pop(key, None)
    env = DistEnv(rank=rank, world_size=layout.world_size,
                  local_rank=rank % layout.ranks_per_node,
                  local_world_size=layout.ranks_per_node, master_addr=where["addr"],
                  master_port=where["port"], launcher=where["launcher"],
                  restart=where["restart"])
    return cfg, layout, env, incarnation


def spawn_tp_ranks(layout: Layout, env: DistEnv, incarnation: str,
                   argv: list[str]) -> list[subprocess.Popen]:
    """On tp rank 0 of a replacement engine of tp > 1: start its other tp ranks (`python -m
    llamarl.launch --join ...` again, told their place by TP_RANK_ENV); each dies with this
    process (PR_SET_PDEATHSIG)."""
    from llamarl.runtime.gpus import GPU_INDEX_ENV, VISIBLE

    role = layout.role_of(env.rank)

    def child_env(k: int) -> dict:
        child = {**os.environ, TP_RANK_ENV: f"{role.index}:{incarnation}:{k}"}
        if GPU_INDEX_ENV in os.environ:  # placed already (a supervisor's child, on GPU):
            # this process sees the engine's tp GPUs (runtime/gpus.py); tp rank k takes GPU k
            visible = [g for g in os.environ.get(VISIBLE, "").split(",") if g.strip()]
            if len(visible) < layout.tp:
                raise ValueError(
                    f"a replacement of generator {role.index} (generator.tp {layout.tp}) sees "
                    f"{len(visible)} GPU(s) (CUDA_VISIBLE_DEVICES={os.environ.get(VISIBLE)!r}), "
                    f"not its {layout.tp}: start it where its tp GPUs are visible to one "
                    "process")
            child[GPU_INDEX_ENV] = str(k)
        return child

    return [subprocess.Popen([sys.executable, "-m", "llamarl.launch", *argv],
                             env=child_env(k), preexec_fn=die_with_parent)
            for k in range(1, layout.tp)]


def die_with_parent() -> None:
    """In the child, before exec: SIGKILL this process when its parent (the supervisor) dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the child's watchdog still ends it once the job is gone
        pass
