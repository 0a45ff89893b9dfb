"""Stop a run early and well: `touch RUN_DIR/stop`.

The run then ends after the next trainer step as it ends at `run.steps`: its checkpoint (when
`run.checkpoint_every` > 0), the final policy, the held-out evaluation and the summary, exit
code 0; `run.resume=auto` continues it later (raise nothing: the checkpoint is below
`run.steps`; the file is removed once read). Ctrl-C or SIGTERM stop at once instead, keeping
only the last checkpoint.

Every trainer rank must end at the same step (the final policy is gathered by a collective).
Trainer 0 looks for the file after each step; when it is there it sets `trainer/stop_at` in the
job store to the version after the next step. Each rank reads the key after each step, and all
have read it by then: a rank finishes a step only after every other rank entered it (the step's
collectives), and trainer 0 set the key before it entered the next one.
"""

from __future__ import annotations

from pathlib import Path

from llamarl.runtime.watchdog import peek

STOP_FILE = "stop"
KEY = "trainer/stop_at"


class StopRequest:
    """Whether the run ends at a version before `run.steps` (module docstring)."""

    def __init__(self, store, run_dir: Path, trainer_rank: int):
        self.store = store
        self.path = run_dir / STOP_FILE
        self.lead = trainer_rank == 0
        self.at: int | None = None

    def ends_at(self, version: int) -> bool:
        """Called by every trainer rank after the step that made policy `version`."""
        if self.lead and self.path.exists():
            self.store.compare_set(KEY, "", str(version + 1))  # (the first request wins)
            self.path.unlink(missing_ok=True)  # (a resume continues in this directory)
        if self.at is None:
            value = peek(self.store, KEY)
            if value:
                self.at = int(value)
        return self.at is not None and version >= self.at
