"""The embedded tiny model's teacher (algorithm.teacher_path = tiny-grpo:reverse): the final policy
of the default GRPO recipe (recipes/tiny_grpo_cpu.yaml, from the tiny warm start), trained once
and cached.

Trainer 0 of the run that needs it builds it the first time, as the warm start is built, by
launching that recipe as a job of its own (`python -m llamarl.launch`, its own torchrun world of
3 ranks, without evaluations during training or checkpoints) while the ranks of its own job
wait; the launch's final policy (RUN_DIR/policy, a Hugging Face directory) becomes the teacher.
On a 2-core machine that takes about 4 minutes. The cache entry is
$LLAMARL_CACHE/tiny-teacher-reverse-<hash>, the hash over what determines the teacher: the
recipe as resolved (every key, the output directory aside), the warm start it starts from (its
own cache key) and VERSION; the launch's log and held-out rewards are kept beside it
(<entry>.log, <entry>/teacher_eval.jsonl).
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

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_grpo_cpu.yaml"
OVERRIDES = ["run.name=tiny-teacher", "run.eval_every=0", "run.checkpoint_every=0"]
VERSION = 1  # bump when the build below changes what it produces
# The launch's limit. The waiting ranks of the job that builds it allow this much more at
# start (generator: the wait for the model path; trainers: the barrier, sync.timeout_s).
BUILD_TIMEOUT_S = 1500.0
# What a launcher put in this process's environment: the teacher's launch starts a job of its
# own, so none of it may leak into it (it would join this job's world instead).
_JOB_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "OMP_NUM_THREADS", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def _recipe():
    from llamarl.config import load_config

    if not RECIPE.is_file():
        raise ValueError(f"algorithm.teacher_path tiny-grpo:reverse is built with {RECIPE}, "
                         "which is missing: run from a checkout of llamarl (pip install -e .), "
                         "or point algorithm.teacher_path at a trained policy directory")
    return load_config(RECIPE, OVERRIDES)


def teacher_dir() -> Path:
    """The cache entry of the teacher (it may not exist yet)."""
    from llamarl.config import config_to_yaml
    from llamarl.tiny.warmstart import cache_root, warm_start_dir

    cfg = _recipe()
    cfg.run.output_dir = ""  # where the launch writes its run is not part of what it trains
    blob = json.dumps({"recipe": config_to_yaml(cfg), "warm_start": warm_start_dir("reverse").name,
                       "version": VERSION}, sort_keys=True)
    return cache_root() / f"tiny-teacher-reverse-{hashlib.sha1(blob.encode()).hexdigest()[:10]}"


def build_teacher(out_dir: Path, log=print) -> None:
    """Launch the default recipe and keep its final policy as `out_dir` (atomically: a build
    that fails or is killed leaves no entry)."""
    cfg = _recipe()
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = out_dir.parent / f"{out_dir.name}.log"
    log(f"building the tiny teacher: {RECIPE.name}, {cfg.run.steps} GRPO steps, launched as a "
        f"job of its own (log: {log_path}; cached at {out_dir})")
    env = {k: v for k, v in os.environ.items()
           if k not in _JOB_ENV and not k.startswith("TORCHELASTIC_")}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}.", dir=out_dir.parent) as runs:
        cmd = [sys.executable, "-m", "llamarl.launch", str(RECIPE), f"run.output_dir={runs}",
               *OVERRIDES]
        with open(log_path, "w") as f:
            try:
                proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                      cwd=RECIPE.parents[1], timeout=BUILD_TIMEOUT_S)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = f"timed out after {BUILD_TIMEOUT_S:.0f} s"
        run_dirs = [p for p in Path(runs).iterdir() if p.is_dir()]
        policy = run_dirs[0] / "policy" if len(run_dirs) == 1 else Path(runs) / "none"
        if code != 0 or not (policy / "config.json").is_file():
            last = [x for x in log_path.read_text().splitlines() if x.strip()][-1:] or [""]
            raise RuntimeError(f"building the tiny teacher failed ({code}): {last[0][:300]} "
                               f"(the whole log: {log_path})")
        evals = (run_dirs[0] / "eval.jsonl").read_text()
        (policy / "teacher_eval.jsonl").write_text(evals)
        if out_dir.exists():  # another job built it meanwhile
            shutil.rmtree(out_dir)
        os.replace(policy, out_dir)
    rows = [json.loads(x) for x in evals.splitlines()]
    log(f"tiny teacher built in {time.monotonic() - t0:.0f} s: held-out reward "
        f"{rows[0]['reward_mean']:.3f} -> {rows[-1]['reward_mean']:.3f}")
