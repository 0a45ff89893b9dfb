"""Per-rank phase timeline: what each rank was doing when, for finding overlap and idle bubbles.

Each rank appends one JSON line per phase to RUN_DIR/timeline/rank<r>.jsonl:

    {"rank": 2, "role": "generator 0", "phase": "generate", "start": 1.7e9, "end": 1.7e9,
     "step": 12}

Times are wall-clock seconds (time.time()), comparable across the ranks of one host and, with
synchronised clocks, across hosts. `python -m llamarl.plot RUN_DIR` draws them.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path


class Timeline:
    def __init__(self, run_dir: Path, rank: int, role: str):
        path = Path(run_dir) / "timeline" / f"rank{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", buffering=1)
        self.rank, self.role = rank, role

    def record(self, phase: str, start: float, end: float, step: int | None = None) -> None:
        self._f.write(json.dumps({"rank": self.rank, "role": self.role, "phase": phase,
                                  "start": start, "end": end, "step": step}) + "\n")

    @contextmanager
    def phase(self, name: str, step: int | None = None):
        start = time.time()
        try:
            yield
        finally:
            self.record(name, start, time.time(), step)

    def close(self) -> None:
        self._f.close()


def read(run_dir: Path) -> list[dict]:
    rows = []
    for path in sorted((Path(run_dir) / "timeline").glob("rank*.jsonl")):
        rows += read_jsonl(path)
    return rows


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines log; a line that a killed process left half-written is
    skipped with a note (the rest of the run is still worth reading)."""
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"llamarl: skipped the broken line {n} of {path}", file=sys.stderr)
    return rows
