"""The watchdog's load on the job store is a constant per rank: bench/watchdog_store_load.py on
64 ranks, 8 a node (their real loop, two client processes, one TCPStore), read from its result
file.

Each rank reads a handful of keys a sweep (its heartbeat, the failure key, the roster's change
count, its nearest live successors' heartbeats: runtime/watchdog.py), so the store reads ~5
keys per rank a second whatever N; the sweep that read every rank's counter read N + 2 (66 at
N = 64), the per-peer one before it 2 N. Nobody is reported dead: every rank runs. The figures
at 256-1024 ranks are the benchmark's (docs/scaling.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS_PER_RANK_S = 10  # the budget (issue 69): ~10 N keys a second for N ranks


def test_sixty_four_watchdogs_read_a_constant_number_of_keys_per_rank(tmp_path):
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, "bench/watchdog_store_load.py", "--ranks", "64",
                           "--processes", "2", "--seconds", "8", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(out.read_text())["rows"][0]
    assert row["false_dead_reports"] == 0, row["first_reports"]
    assert row["store_keys_per_rank_s"] <= KEYS_PER_RANK_S, row
    assert row["store_calls_per_rank_s"] <= KEYS_PER_RANK_S, row
    assert row["sweep_period_s_median"] < 1.5, row  # HEARTBEAT_S, plus a cheap sweep
