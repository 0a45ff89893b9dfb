"""Sharded checkpoints (torch.distributed.checkpoint) of the trainer, written atomically.

Layout, under RUN_DIR/checkpoints/:

    step_00000006/              complete: the only form `latest()` ever returns
      .metadata, __*_*.distcp   DCP shards of {"model", "optim"} (+ {"critic", "critic_optim"}
                                for PPO), written by every trainer rank; a LoRA policy's
                                "model" holds its adapters only (model.lora in meta.json)
      rng_rank<r>.pt            each trainer rank's torch RNG state
      meta.json                 step, policy version, LR schedule, each engine's prompt-loader
                                state after the last batch trained on, the base model directory
                                (for the config and tokenizer)
    step_00000009.partial/      being written, or left by a crash: ignored, removed later

Atomicity: every rank writes into `step_N.partial/`; after a barrier trainer 0 writes
meta.json last and renames the directory to `step_N/` (one rename on one filesystem), then
removes checkpoints beyond the newest `keep`. A kill at any point leaves the previous complete
checkpoint as the newest one. A resumed run removes the `.partial` directories it finds
(`remove_partials`); so does every later save.

Test hook: LLAMARL_TEST_CHECKPOINT_PAUSE_S=SECONDS makes trainer 0 sleep that long inside every
save, after all shards are on disk and before meta.json and the rename, so that
tests/test_resume.py can SIGKILL a rank while a real checkpoint write is open. Never set it in
real runs.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from llamarl.errors import first_line
from llamarl.runtime.run_dir import PARTIAL, checkpoint_dir, remove_partials
from llamarl.trainer.lora import has_adapters, is_trainable

TEST_PAUSE_ENV = "LLAMARL_TEST_CHECKPOINT_PAUSE_S"


def save(run_dir: Path, step: int, model, optimizer, scheduler, meta: dict, keep: int,
         critic=None) -> Path:
    """Collective over the trainer ranks. Returns the complete checkpoint's path. `critic`:
    PPO's critic trainer (model, optimizer, schedule), saved beside the policy."""
    rank = dist.get_rank()
    final = checkpoint_dir(run_dir) / f"step_{step:08d}"
    tmp = final.with_name(final.name + PARTIAL)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    with _one_line_errors("writing checkpoint", tmp):
        dcp.save(_state(model, optimizer, critic), checkpoint_id=str(tmp))
    torch.save(torch.get_rng_state(), tmp / f"rng_rank{rank}.pt")
    dist.barrier()  # every rank's shards are on disk
    if rank == 0:
        time.sleep(float(os.environ.get(TEST_PAUSE_ENV) or 0))  # test hook, see the docstring
        full_meta = dict(meta, step=step, scheduler=scheduler.state_dict())
        if critic is not None:
            full_meta["critic_scheduler"] = critic.sched.state_dict()
        (tmp / "meta.json").write_text(json.dumps(full_meta, indent=1))
        os.replace(tmp, final)  # the commit point
        _prune(checkpoint_dir(run_dir), keep)
    dist.barrier()
    return final


def _options(model) -> StateDictOptions:
    """A LoRA policy's checkpoint holds its adapters (and modules_to_save's trained copies) and
    their optimizer state, not the frozen base weights (they are reloaded from model.path): its
    state dict leaves out frozen parameters, and loading it leaves them as they are
    (strict=False; dcp.load still fails on an adapter the checkpoint lacks)."""
    lora = has_adapters(model)
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def _state(model, optimizer, critic) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
    if has_adapters(model):  # (a tied lm_head.weight is kept by ignore_frozen_params)
        model_sd = {k: v for k, v in model_sd.items() if is_trainable(k)}
    state = {"model": model_sd, "optim": optim_sd}
    if critic is not None:
        state["critic"], state["critic_optim"] = get_state_dict(critic.model, critic.opt)
    return state


@contextmanager
def _kernel_kept(optimizer):
    """Loading an optimizer's state also loads the saving run's `fused`/`foreach` flags (a
    checkpoint written on a CPU would turn a GPU run's fused AdamW off): keep this run's."""
    kept = [{k: g.get(k) for k in ("fused", "foreach")} for g in optimizer.param_groups]
    yield
    for group, flags in zip(optimizer.param_groups, kept):
        group.update(flags)


def load(path: Path, model, optimizer, scheduler, critic=None) -> dict:
    """Collective over the trainer ranks: restore model, optimizer, schedule and RNG (and the
    critic's model, optimizer and schedule)."""
    meta = json.loads((Path(path) / "meta.json").read_text())
    if critic is not None and "critic_scheduler" not in meta:
        raise ValueError(f"checkpoint {path} has no critic (it was not written by a PPO run): "
                         "resume it with the algorithm it was trained with")
    state = _state(model, optimizer, critic)
    with _one_line_errors("loading checkpoint", path):
        dcp.load(state, checkpoint_id=str(path))
    with _kernel_kept(optimizer):
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=_options(model))
    scheduler.load_state_dict(meta["scheduler"])
    if critic is not None:
        with _kernel_kept(critic.opt):
            set_state_dict(critic.model, critic.opt, model_state_dict=state["critic"],
                           optim_state_dict=state["critic_optim"])
        critic.sched.load_state_dict(meta["critic_scheduler"])
    rng = Path(path) / f"rng_rank{dist.get_rank()}.pt"
    if rng.exists():
        torch.set_rng_state(torch.load(rng))
    return meta


@contextmanager
def _one_line_errors(what: str, path: Path):
    """DCP reports any rank's failure as `CheckpointException ranks:dict_keys([0, 1])` with
    every rank's traceback (hundreds of lines); say the cause and the fix in one line."""
    try:
        yield
    except CheckpointException as e:
        ranks = sorted(e.failures)
        exc = e.failures[ranks[0]][0] if ranks else e
        cause = first_line(exc)
        text = cause.lower()
        if "no space left" in text:
            fix = "free disk space under run.output_dir or lower run.keep_checkpoints"
        elif "size mismatch" in text or "shape" in text or "missing key" in text:
            fix = ("the checkpoint holds another model's weights: resume with the model.path "
                   "(and algorithm) it was written with, or start a new run")
        else:
            fix = "check the checkpoint directory and the filesystem"
        raise RuntimeError(f"{what} {path} failed on trainer rank(s) {ranks}: "
                           f"{type(exc).__name__}: {cause}: {fix}") from None


def _prune(root: Path, keep: int) -> None:
    complete = sorted((p for p in root.glob("step_*") if not p.name.endswith(PARTIAL)),
                      key=lambda p: int(p.name.split("_")[1]))
    for old in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    remove_partials(root.parent)  # left by a crash
