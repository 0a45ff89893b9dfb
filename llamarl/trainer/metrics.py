"""metrics.jsonl (one JSON object per trainer step), TensorBoard scalars when tensorboard is
installed (RUN_DIR/tensorboard), and the one-line progress report."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)  # line-buffered: readable while running
        self._tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(str(self.path.parent / "tensorboard"))
        except ImportError:  # tensorboard is optional
            pass

    def write(self, row: dict) -> None:
        self._f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(key, value, row["step"])
            self._tb.flush()

    @staticmethod
    def line(row: dict, total_steps: int) -> str:
        tok_s = row["tokens_generated"] / max(row["generate_s"], 1e-9)
        notes = ""  # only when something happened
        if row.get("reward_errors") or row.get("reward_timeouts"):
            notes += (f" | reward errors {row['reward_errors']} timeouts "
                      f"{row['reward_timeouts']}")
        if row.get("ds_rounds", 1) > 1 or row.get("ds_filled_groups"):
            notes += (f" | dyn. sampling rounds {row['ds_rounds']} dropped "
                      f"{row['ds_dropped_groups']} filled {row['ds_filled_groups']}")
        return (f"step {row['step']}/{total_steps} reward {row['reward_mean']:.3f} "
                f"len {row['response_len']:.1f} ent {row['entropy']:.2f} "
                f"kl_mis {row['mismatch_kl']:.1e} clip {row['clip_frac']:.3f} "
                f"stale {row['staleness_mean']:.1f} | step {row['step_time_s']:.2f}s = "
                f"wait {row['wait_s']:.2f} train {row['train_s']:.2f} sync {row['sync_s']:.3f}"
                f" | gen {tok_s:.0f} tok/s, train {row['train_tokens_per_s']:.0f} tok/s"
                + notes)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()
