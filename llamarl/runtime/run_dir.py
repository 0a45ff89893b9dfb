"""The run directory on disk: where a run writes (RUN_DIR = run.output_dir/<name>-<id>), and
what rank 0 reads of it before any role starts: the checkpoint to resume from (run.resume, or
after the launcher restarted the job the failed attempt's newest one), the rows of the crashed
launch to drop, the half-written checkpoints to remove.

    RUN_DIR/recipe.yaml, layout.json, store.json (where `--join` finds the job), ranks.jsonl
    RUN_DIR/checkpoints/step_<N>/ (complete) and step_<N>.partial/ (trainer/checkpoint.py
    writes them), metrics.jsonl, eval.jsonl, samples/
"""

from __future__ import annotations

import json
import secrets
import shutil
import sys
import time
from pathlib import Path

from llamarl.config import Config, config_to_yaml
from llamarl.runtime.dist_env import DistEnv
from llamarl.runtime.job_store import job_identity, job_prefix
from llamarl.runtime.layout import Layout

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


def remove_partials(run_dir: Path) -> list[Path]:
    """Delete the half-written checkpoints a crash left in a run directory; returns them.
    Only safe while no save is running in that directory (at resume, or inside `save`)."""
    partials = sorted(checkpoint_dir(run_dir).glob(f"step_*{PARTIAL}"))
    for partial in partials:
        shutil.rmtree(partial, ignore_errors=True)
    return partials


def truncate_after(run_dir: Path, step: int) -> int:
    """Resuming at `step`: drop the rows of metrics.jsonl, eval.jsonl and samples/train.jsonl
    beyond it, and the evaluations' samples/eval_<k>.jsonl of k > step (they are about to be
    produced again), so each step appears once. Returns the rows dropped (metrics and eval)."""
    for path in Path(run_dir).glob("samples/eval_*.jsonl"):
        if int(path.stem.removeprefix("eval_")) > step:
            path.unlink()
    dropped = 0
    for name in ("metrics.jsonl", "eval.jsonl", "samples/train.jsonl"):
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        keep = []
        for line in path.read_text().splitlines():
            try:
                row_step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):  # a line torn by the crash
                row_step = step + 1
            if row_step <= step:
                keep.append(line)
            elif name != "samples/train.jsonl":
                dropped += 1
        path.write_text("".join(x + "\n" for x in keep))
    return dropped


def make_run_dir(cfg: Config, layout: Layout, env: DistEnv, store, raw) -> None:
    """Rank 0: the run directory (new, the resumed run's, or after a restart of the job the
    failed attempt's) and its first files, published in the store for every rank."""
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
    resume, run_dir = _resume_point(cfg), None
    if resume is None and not cfg.run.resume and env.restart > 0:
        resume, run_dir = _restart_point(cfg, env, raw)
    if resume is not None:  # continue in the run directory of the checkpoint
        run_dir = resume.parent.parent
        store.set("resume", json.dumps({"checkpoint": str(resume), **json.loads(
            (resume / "meta.json").read_text())}))
    else:
        if run_dir is None:
            run_dir = Path(cfg.run.output_dir).resolve() / f"{cfg.run.name}-{run_id}"
            run_dir.mkdir(parents=True, exist_ok=False)
        store.set("resume", "{}")
        (run_dir / "recipe.yaml").write_text(config_to_yaml(cfg))  # a resume: once loaded
    (run_dir / "layout.json").write_text(json.dumps({
        "world_size": layout.world_size, "trainer_ranks": layout.trainer_ranks,
        "engines": layout.engines, "tp": layout.tp, "launcher": env.launcher,
        "ranks_per_node": layout.ranks_per_node}, indent=1))
    # where a replacement engine finds the job (python -m llamarl.launch --join RUN_DIR)
    (run_dir / "store.json").write_text(json.dumps({
        "addr": env.master_addr, "port": env.master_port, "restart": env.restart,
        "launcher": env.launcher, "job": job_identity()}, indent=1))
    store.set("run", json.dumps({"id": run_id, "dir": str(run_dir)}))


def _restart_point(cfg: Config, env: DistEnv, raw) -> tuple[Path | None, Path | None]:
    """After the launcher restarted the job (torchrun --max-restarts, Slurm requeue): the
    newest complete checkpoint of the failed attempt's run directory and that directory.
    torchrun's agent store outlives the attempts, so the directory is read from the last
    attempt's keys; under Slurm the store is new and the run is found by name."""
    run_dir = None
    for attempt in range(env.restart - 1, -1, -1):
        key = f"{job_prefix(attempt)}/run"
        if env.agent_store and raw.check([key]):
            run_dir = Path(json.loads(raw.get(key))["dir"])
            break
    found = (latest(run_dir) if run_dir is not None else
             find_resume("auto", Path(cfg.run.output_dir).resolve(), cfg.run.name))
    if found is not None:
        print(f"llamarl: restart {env.restart} of the job: resuming from {found} by itself "
              f"(a checkpoint every run.checkpoint_every = {cfg.run.checkpoint_every} steps)",
              file=sys.stderr, flush=True)
        return _continue_from(found, cfg.run.steps), None
    if run_dir is not None and run_dir.is_dir():
        truncate_after(run_dir, -1)  # nothing to keep: start over in the same directory
        print(f"llamarl: restart {env.restart} of the job: no complete checkpoint yet, "
              f"starting over in {run_dir}", file=sys.stderr, flush=True)
        return None, run_dir
    return None, None


def _resume_point(cfg: Config) -> Path | None:
    if not cfg.run.resume:
        return None
    found = find_resume(cfg.run.resume, Path(cfg.run.output_dir).resolve(), cfg.run.name)
    if found is None:
        print(f"llamarl: run.resume=auto found no complete checkpoint of '{cfg.run.name}' under "
              f"{cfg.run.output_dir}: starting a new run", file=sys.stderr, flush=True)
        return None
    return _continue_from(found, cfg.run.steps)


def _continue_from(found: Path, steps: int) -> Path:
    """Make the run directory of checkpoint `found` ready to continue from it (up to `steps`,
    run.steps): checked before any file changes and before any rank starts its model."""
    meta = json.loads((found / "meta.json").read_text())
    if meta["policy_version"] >= steps:
        raise ValueError(f"the checkpoint {found} is at step {meta['policy_version']}, already "
                         f"run.steps = {steps}: raise run.steps to continue")
    for partial in remove_partials(found.parent.parent):  # the run we continue in
        print(f"llamarl: removed the half-written checkpoint {partial} (a crash left it)",
              file=sys.stderr, flush=True)
    step = meta["step"]
    dropped = truncate_after(found.parent.parent, step)
    if dropped:
        print(f"llamarl: dropped {dropped} metrics/eval row(s) after step {step} from the "
              "crashed launch (they are produced again)", file=sys.stderr, flush=True)
    return found


