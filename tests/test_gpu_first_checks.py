"""bench/gpu_first_checks.sh --dry-run: everything the GPU machine's first-minutes script would
run is in the checkout (the GPU tests and their marker, the benches and the arguments it passes
them) and its limits add up to under 8 minutes; a checkout missing a piece fails it."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "bench/gpu_first_checks.sh"


def dry_run(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(root / SCRIPT), "--dry-run"], capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin",
                                                       "PYTHON": sys.executable})


def test_the_dry_run_finds_everything_it_would_run():
    proc = dry_run(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dry run: ok" in proc.stdout
    for step in ("env", "gpu_tests", "mfu_0.5b", "kv_room"):
        assert f"would run: {step}" in proc.stdout


def test_the_dry_run_fails_on_a_checkout_missing_a_piece(tmp_path):
    for part in (SCRIPT, "bench/trainer_throughput.py", "tests/test_gpu.py",
                 "tests/test_reward_model.py", "tests/conftest.py", "setup.cfg"):
        (tmp_path / part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / part, tmp_path / part)
    proc = dry_run(tmp_path)  # no bench/engine_kv_room.py
    assert proc.returncode != 0 and "missing: bench/engine_kv_room.py" in proc.stdout, proc.stdout
