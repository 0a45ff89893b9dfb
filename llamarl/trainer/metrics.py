"""metrics.jsonl (one JSON object per trainer step) and the one-line progress report."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)  # line-buffered: readable while running

    def write(self, row: dict) -> None:
        self._f.write(json.dumps(row) + "\n")

    @staticmethod
    def line(row: dict, total_steps: int) -> str:
        tok_s = row["tokens_generated"] / max(row["generate_s"], 1e-9)
        return (f"step {row['step']}/{total_steps} reward {row['reward_mean']:.3f} "
                f"len {row['response_len']:.1f} clip {row['clip_frac']:.3f} "
                f"kl_mis {row['mismatch_kl']:.1e} | step {row['step_time_s']:.2f}s = "
                f"wait {row['wait_s']:.2f} xfer {row['transfer_s']:.3f} "
                f"train {row['train_s']:.2f} sync {row['sync_s']:.3f} | gen {tok_s:.0f} tok/s")

    def close(self) -> None:
        self._f.close()
