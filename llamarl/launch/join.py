"""`python -m llamarl.launch --join RUN_DIR [key=value ...]`: start a replacement for a lost
engine of a running job (launch/roster.py).

The run directory says where the job's store is (`store.json`), its recipe and its layout. The
replacement claims the first lost engine nobody replaces yet and takes its global rank: the
watchdogs of the other ranks watch that rank again once this process deletes its `done/<rank>`
mark. It then starts its engine, receives the trainers' weights from the sync trainer 0 picks
for it (trainer/weight_members.py), rejoins the roster and takes its slot back from the engine
that made it meanwhile, at that engine's next batch boundary (generator/slots.py).
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import torch.distributed as dist

from llamarl.config import Config, load_config
from llamarl.launch.dist_env import DistEnv
from llamarl.launch.job_store import job_prefix
from llamarl.launch.layout import Layout, compute_layout
from llamarl.launch.roster import Roster
from llamarl.parallel.groups import connect_store


def plan_join(run_dir: str, overrides: list[str]) -> tuple[Config, Layout, DistEnv, str]:
    """The recipe, layout and place in the job of a replacement engine, and its incarnation
    (claimed in the store, so two replacements never take the same engine)."""
    root = Path(run_dir)
    if not (root / "store.json").is_file():
        raise ValueError(f"--join {run_dir}: not a run directory of a running job (no "
                         "store.json): give the directory the job prints as 'run directory:'")
    where = json.loads((root / "store.json").read_text())
    shape = json.loads((root / "layout.json").read_text())
    cfg = load_config(str(root / "recipe.yaml"), overrides)
    layout = compute_layout(shape["world_size"], shape["ranks_per_node"], shape["trainer_ranks"],
                            shape["engines"], shape["tp"])
    if layout.tp > 1:
        raise ValueError(f"--join {run_dir}: the job's engines have generator.tp = {layout.tp}, "
                         "and a replacement joins as one rank: an engine of several ranks "
                         "is not replaced (the job goes on with the engines it has)")
    try:
        raw = connect_store(where["addr"], where["port"], 15.0)
    except Exception as e:  # noqa: BLE001 - one line
        raise ValueError(f"--join {run_dir}: cannot reach the job's store at {where['addr']}:"
                         f"{where['port']} ({type(e).__name__}): is the job still running, and "
                         "is this host able to reach it?") from None
    store = dist.PrefixStore(job_prefix(where["restart"]), raw)
    lost = Roster(store, layout.engines).read().lost
    incarnation = secrets.token_hex(3)
    engine = next((e for e in lost if store.compare_set(
        f"join/{e}/claimed", "", incarnation).decode() == incarnation), None)
    if engine is None:
        raise ValueError(f"--join {run_dir}: no engine of this job is lost (or each lost one "
                         f"is being replaced already): nothing to replace")
    rank = layout.engine_global_ranks(engine)[0]
    # the store checks that it is this job's (launch/job_store.py): be that job
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
