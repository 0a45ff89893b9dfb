"""Where a trainer step's time went: the metrics row's wait_s, transfer_s, train_s, sync_s and
checkpoint_s, and the period from one row to the next (step_time_s) with what the parts leave
out (other_s)."""

from __future__ import annotations

import contextlib
import time


class StepTimer:
    """Created when the loop starts (after the first weights are sent): elapsed_s counts from
    then. step_time_s is the period from one step's row to the next: the parts plus the
    trainer's own work between them (writing the row, logging, TensorBoard), so that the step
    times sum to the run's wall-clock time, as a peer's per-step clock reads it."""

    PARTS = ("wait_s", "transfer_s", "train_s", "sync_s", "checkpoint_s")

    def __init__(self):
        self.run_t0 = self.t_row = time.perf_counter()
        self.parts: dict[str, float] = dict.fromkeys(self.PARTS, 0.0)

    def begin(self, wait_s: float, transfer_s: float) -> None:
        """A new step, whose rollouts took `wait_s` blocked and `transfer_s` copying."""
        self.parts = dict.fromkeys(self.PARTS, 0.0)
        self.parts.update(wait_s=wait_s, transfer_s=transfer_s)

    @contextlib.contextmanager
    def measure(self, part: str):
        """Times the block as this step's `part` (0 when the block does not run: no
        checkpoint this step)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.parts[part] = time.perf_counter() - t0

    def close_period(self, timed_elsewhere_s: float = 0.0) -> dict[str, float]:
        """step_time_s, other_s and elapsed_s of the row being written now. other_s: the
        trainer's bookkeeping that no part holds (the last row's metrics and log line, this
        one's statistics, the batch's assembly); `timed_elsewhere_s`: step time that a feature
        reports itself (the trainer-side reward model's reward_model_s)."""
        now = time.perf_counter()
        period = now - self.t_row
        self.t_row = now
        return {"step_time_s": period,
                "other_s": period - (sum(self.parts.values()) + timed_elsewhere_s),
                "elapsed_s": now - self.run_t0}
