"""The watchdog's load on the job store stays linear in the ranks: bench/watchdog_store_load.py
on 64 ranks (their real loop, two client processes, one TCPStore), read from its result file.

Each rank makes a handful of store calls a sweep (its heartbeat, the failure key, one read of
every counter), so the store serves a few calls per rank a second; the per-peer sweep it
replaced made 2 (N - 1) + 2 per rank (128 at N = 64). Nobody is reported dead: every rank runs.
The figures at 256-1024 ranks are the benchmark's (docs/scaling.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sixty_four_watchdogs_load_the_store_linearly(tmp_path):
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, "bench/watchdog_store_load.py", "--ranks", "64",
                           "--processes", "2", "--seconds", "8", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(out.read_text())["rows"][0]
    assert row["false_dead_reports"] == 0, row["first_reports"]
    assert row["store_calls_per_rank_s"] <= 10, row
    assert row["sweep_period_s_median"] < 1.5, row  # HEARTBEAT_S, plus a cheap sweep
