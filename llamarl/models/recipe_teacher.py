"""Teachers named in a recipe (algorithm.teacher_path = tiny-grpo:reverse or smollm2-grpo:add): the
final policy of one of llamarl's own recipes, trained once and cached.

  tiny-grpo:reverse   recipes/tiny_grpo_cpu.yaml: the embedded tiny model after the default
                      GRPO recipe (250 steps from the tiny warm start; about 4 minutes on 2 cores)
  smollm2-grpo:add    recipes/smollm2_add_cpu.yaml: SmolLM2-135M-Instruct after 30 GRPO steps on
                      2-digit additions (about 8 minutes on 2 cores)

Trainer 0 of the run that needs one builds it the first time, as the warm start is built, by
launching that recipe as a job of its own (`python -m llamarl.launch`, its own torchrun world,
without evaluations during training or checkpoints) while the ranks of its own job wait; the
launch's final policy (RUN_DIR/policy, a Hugging Face directory) becomes the teacher. The cache
entry is $LLAMARL_CACHE/<prefix>-<hash>, the hash over what determines the teacher: the recipe
as resolved (every key, the output directory aside), the cache entry of the model it starts
from and VERSION; the launch's log and held-out rewards are kept beside it (<entry>.log,
<entry>/teacher_eval.jsonl).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
VERSION = 1  # bump when the build below changes what it produces
# The launch's limit. The waiting ranks of the job that builds it allow this much more at
# start (generator: the wait for the model path; trainers: the barrier, sync.timeout_s).
BUILD_TIMEOUT_S = 2400.0
# What a launcher put in this process's environment: the teacher's launch starts a job of its
# own, so none of it may leak into it (it would join this job's world instead).
_JOB_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "OMP_NUM_THREADS", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def _recipe(name: str):
    """The recipe that trains teacher `name`, loaded with the build's overrides."""
    from llamarl.config import RECIPE_TEACHERS, load_config

    recipe = RECIPES / RECIPE_TEACHERS[name]
    if not recipe.is_file():
        raise ValueError(f"algorithm.teacher_path {name} is built with {recipe}, which is "
                         "missing: run from a checkout of llamarl (pip install -e .), or point "
                         "algorithm.teacher_path at a trained policy directory")
    overrides = [f"run.name={name.split('-')[0]}-teacher", "run.eval_every=0",
                 "run.checkpoint_every=0"]
    return recipe, load_config(recipe, overrides), overrides


def _prefix(name: str) -> str:
    """tiny-grpo:reverse -> tiny-teacher-reverse (the cache entry's and the run's name)."""
    model, task = name.split(":")
    return f"{model.split('-')[0]}-teacher-{task}"


def _start_entry(model_path: str) -> str:
    """The cache entry of the model the recipe starts from (its weights are part of the key)."""
    from llamarl.models.smollm2 import model_dir
    from llamarl.models.tiny import warm_start_dir

    if model_path.startswith("tiny:"):
        return warm_start_dir(model_path.split(":", 1)[1]).name
    if model_path.startswith("smollm2:"):
        return model_dir(model_path.split(":", 1)[1]).name
    return model_path


def teacher_dir(name: str) -> Path:
    """The cache entry of teacher `name` (it may not exist yet)."""
    from llamarl.config import config_to_yaml
    from llamarl.models import cache_root

    _, cfg, _ = _recipe(name)
    cfg.run.output_dir = ""  # where the launch writes its run is not part of what it trains
    # ("warm_start": the key's name when only the tiny teacher existed, kept so that its
    # cache entry stays where it was)
    blob = json.dumps({"recipe": config_to_yaml(cfg), "warm_start": _start_entry(cfg.model.path),
                       "version": VERSION}, sort_keys=True)
    return cache_root() / f"{_prefix(name)}-{hashlib.sha1(blob.encode()).hexdigest()[:10]}"


def build_teacher(name: str, out_dir: Path, log=print) -> None:
    """Launch teacher `name`'s recipe and keep its final policy as `out_dir` (atomically: a
    build that fails or is killed leaves no entry)."""
    recipe, cfg, overrides = _recipe(name)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = out_dir.parent / f"{out_dir.name}.log"
    log(f"building the teacher {name}: {recipe.name}, {cfg.run.steps} steps, launched as a "
        f"job of its own (log: {log_path}; cached at {out_dir})")
    env = {k: v for k, v in os.environ.items()
           if k not in _JOB_ENV and not k.startswith("TORCHELASTIC_")}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}.", dir=out_dir.parent) as runs:
        cmd = [sys.executable, "-m", "llamarl.launch", str(recipe), f"run.output_dir={runs}",
               *overrides]
        with open(log_path, "w") as f:
            try:
                proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                      cwd=RECIPES.parent, timeout=BUILD_TIMEOUT_S)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = f"timed out after {BUILD_TIMEOUT_S:.0f} s"
        run_dirs = [p for p in Path(runs).iterdir() if p.is_dir()]
        policy = run_dirs[0] / "policy" if len(run_dirs) == 1 else Path(runs) / "none"
        if code != 0 or not (policy / "config.json").is_file():
            last = [x for x in log_path.read_text().splitlines() if x.strip()][-1:] or [""]
            raise RuntimeError(f"building the teacher {name} failed ({code}): {last[0][:300]} "
                               f"(the whole log: {log_path})")
        evals = (run_dirs[0] / "eval.jsonl").read_text()
        (policy / "teacher_eval.jsonl").write_text(evals)
        if out_dir.exists():  # another job built it meanwhile
            shutil.rmtree(out_dir)
        os.replace(policy, out_dir)
    rows = [json.loads(x) for x in evals.splitlines()]
    log(f"teacher {name} built in {time.monotonic() - t0:.0f} s: held-out reward "
        f"{rows[0]['reward_mean']:.3f} -> {rows[-1]['reward_mean']:.3f}")
