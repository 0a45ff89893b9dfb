"""Sharded checkpoints (torch.distributed.checkpoint) of the trainer, written atomically.

Layout, under RUN_DIR/checkpoints/:

    step_00000006/              complete: the only form `latest()` ever returns
      .metadata, __*_*.distcp   DCP shards of {"model": ..., "optim": ...} (every trainer rank)
      rng_rank<r>.pt            each trainer rank's torch RNG state
      meta.json                 step, policy version, LR schedule, each engine's prompt-loader
                                state after the last batch trained on, the base model directory
                                (for the config and tokenizer)
    step_00000009.partial/      being written, or left by a crash: ignored, removed later

Atomicity: every rank writes into `step_N.partial/`; after a barrier trainer 0 writes
meta.json last and renames the directory to `step_N/` (one rename on one filesystem), then
removes checkpoints beyond the newest `keep`. A kill at any point leaves the previous complete
checkpoint as the newest one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

PARTIAL = ".partial"


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run directory, or None."""
    root = checkpoint_dir(run_dir)
    done = [p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(PARTIAL)
            and (p / "meta.json").is_file()] if root.exists() else []
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def find_resume(spec: str, output_dir: Path, name: str) -> Path | None:
    """`run.resume`: "auto" = the newest complete checkpoint among runs named `name` under
    `output_dir`; a checkpoint directory; or a run directory (its newest checkpoint)."""
    if spec == "auto":
        runs = sorted(Path(output_dir).glob(f"{name}-*"), key=lambda p: p.stat().st_mtime)
        for run in reversed(runs):
            found = latest(run)
            if found is not None:
                return found
        return None
    path = Path(spec)
    if (path / "meta.json").is_file():
        return path
    found = latest(path)
    if found is None:
        raise ValueError(f"run.resume {spec!r} is neither a checkpoint nor a run directory with "
                         "a complete checkpoint: pass one, or auto")
    return found


def save(run_dir: Path, step: int, model, optimizer, scheduler, meta: dict, keep: int) -> Path:
    """Collective over the trainer ranks. Returns the complete checkpoint's path."""
    rank = dist.get_rank()
    final = checkpoint_dir(run_dir) / f"step_{step:08d}"
    tmp = final.with_name(final.name + PARTIAL)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save(torch.get_rng_state(), tmp / f"rng_rank{rank}.pt")
    dist.barrier()  # every rank's shards are on disk
    if rank == 0:
        full_meta = dict(meta, step=step, scheduler=scheduler.state_dict())
        (tmp / "meta.json").write_text(json.dumps(full_meta, indent=1))
        os.replace(tmp, final)  # the commit point
        _prune(checkpoint_dir(run_dir), keep)
    dist.barrier()
    return final


def load(path: Path, model, optimizer, scheduler) -> dict:
    """Collective over the trainer ranks: restore model, optimizer, schedule and RNG."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    meta = json.loads((Path(path) / "meta.json").read_text())
    scheduler.load_state_dict(meta["scheduler"])
    rng = Path(path) / f"rng_rank{dist.get_rank()}.pt"
    if rng.exists():
        torch.set_rng_state(torch.load(rng))
    return meta


def _prune(root: Path, keep: int) -> None:
    complete = sorted((p for p in root.glob("step_*") if not p.name.endswith(PARTIAL)),
                      key=lambda p: int(p.name.split("_")[1]))
    for old in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for partial in root.glob(f"step_*{PARTIAL}"):  # left by a crash
        shutil.rmtree(partial, ignore_errors=True)
