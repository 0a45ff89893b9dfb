"""torchrun's per-launch log directories (`torchelastic_*`, its ranks' error files) for a
benchmark's launches: one temporary directory, removed when the benchmark exits, instead of
one directory left in /tmp per launch. torchrun (and `python -m llamarl.launch`, which starts
it) reads its --log-dir from PET_LOG_DIR; the launches inherit this process's environment.
tests/conftest.py does the same for the test suite."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile


def torchrun_logs_in_temp() -> str:
    """Point PET_LOG_DIR at a temporary directory removed at exit (unless the caller set
    PET_LOG_DIR: then that one is kept as it is). Returns the directory."""
    if os.environ.get("PET_LOG_DIR"):
        return os.environ["PET_LOG_DIR"]
    path = tempfile.mkdtemp(prefix="llamarl-bench-torchelastic-")
    os.environ["PET_LOG_DIR"] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
