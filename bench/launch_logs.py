"""torchrun's per-launch log directories (`torchelastic_*`, its ranks' error files) for a
benchmark's launches: one temporary directory, removed when the benchmark exits, instead of
one directory left in /tmp per launch. torchrun (and `python -m llamarl.launch`, which starts
it) reads its --log-dir from PET_LOG_DIR; the launches inherit this process's environment.
tests/conftest.py does the same for the test suite.

`launch_recipe` runs one recipe through `python -m llamarl.launch` and reads back its run."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun_logs_in_temp() -> str:
    """Point PET_LOG_DIR at a temporary directory removed at exit (unless the caller set
    PET_LOG_DIR: then that one is kept as it is). Returns the directory."""
    if os.environ.get("PET_LOG_DIR"):
        return os.environ["PET_LOG_DIR"]
    path = tempfile.mkdtemp(prefix="llamarl-bench-torchelastic-")
    os.environ["PET_LOG_DIR"] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def launch_recipe(recipe: str, overrides: list[str], prefix: str
                  ) -> tuple[Path, list[dict], list[dict]]:
    """Launch `recipe` with `overrides` (key=value) into a new temporary output directory
    named `prefix`..., its output in log.txt there; returns the run directory and its
    metrics.jsonl and eval.jsonl rows. A failed launch raises (its log names the cause)."""
    out = Path(tempfile.mkdtemp(prefix=prefix))
    with open(out / "log.txt", "w") as log:
        subprocess.run([sys.executable, "-m", "llamarl.launch", recipe,
                        f"run.output_dir={out}", *overrides], cwd=ROOT, check=True,
                       stdout=log, stderr=subprocess.STDOUT)
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    rows = [[json.loads(x) for x in (run_dir / name).read_text().splitlines()]
            for name in ("metrics.jsonl", "eval.jsonl")]
    return run_dir, rows[0], rows[1]
