"""metrics.jsonl (one JSON object per trainer step), TensorBoard scalars when tensorboard is
installed (RUN_DIR/tensorboard), and the one-line progress report."""

from __future__ import annotations

import json
import statistics
from numbers import Real
from pathlib import Path

TB_FLUSH_S = 10  # TensorBoard shows a running job's scalars at most this late


# The least "usual" mismatch the alarm compares against, nats per token: a run whose engine
# and trainer agree to float32 rounding (mismatch_kl ~1e-10) would otherwise be reported for a
# bf16-sized 1e-8. With the default factor 10 a step is reported from mismatch_kl 0.1 on.
MISMATCH_FLOOR = 0.01


class MismatchWatch:
    """Reports a step whose engine-vs-trainer mismatch is far beyond the run's usual one.

    mismatch_kl is the k3 estimate of KL(mu || pi_theta) per token between the behaviour
    policy mu (the engine's logprobs of its samples) and the trainer's pi_theta before the
    update; it is ~0 when the engine samples from the trainer's weights (rounding: float32
    ~1e-10, bf16 ~1e-4). A step is reported when

        mismatch_kl > factor x max(median of the earlier steps' mismatch_kl, MISMATCH_FLOOR)

    (factor: sync.mismatch_warn; 0 = never): on the first step as well, so an engine that
    does not hold the trainer's weights (the issue-45 trial: kl_mis 3.5 on step 1) is named
    at once, not after the run.
    """

    def __init__(self, factor: float):
        self.factor = factor
        self.seen: list[float] = []

    def check(self, row: dict) -> str | None:
        """The one-line report of this metrics row, or None."""
        kl = row.get("mismatch_kl", 0.0)
        usual = max(statistics.median(self.seen), MISMATCH_FLOOR) if self.seen else MISMATCH_FLOOR
        self.seen.append(kl)
        if not self.factor or not kl > self.factor * usual:
            return None
        return (f"step {row['step']}: the engine's logprobs disagree with the trainer's "
                f"(mismatch_kl {kl:.3g} per token, over {self.factor:g}x the run's usual "
                f"{usual:.1g}; clip {row.get('clip_frac', 0.0):.3f}): the engine is not "
                "sampling from the trainer's policy. Check that the engine and the trainer load "
                "the same model the same way (model.dtype, a checkpoint's config.json), and "
                "that the temperature the trainer divides by is the engine's; meanwhile "
                "algorithm.correction=icepop (or mis) masks such tokens (sync.mismatch_warn "
                "sets this report's factor, 0 = off)")


class MetricsLog:
    def __init__(self, path: Path, kl_ref: bool = False, resumed_at: int | None = None):
        """`kl_ref`: a reference policy is in the loss, so the progress line shows its KL.
        `resumed_at`: the step a resumed run continues from; TensorBoard purges later events
        left by the crashed launch."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.kl_ref = kl_ref
        self._f = open(self.path, "a", buffering=1)  # line-buffered: readable while running
        self._tb = self._summary = None
        try:
            from tensorboard.compat.proto.summary_pb2 import Summary
            from torch.utils.tensorboard import SummaryWriter
            purge = resumed_at + 1 if resumed_at is not None else None
            # TensorBoard's own thread writes the events and flushes them every TB_FLUSH_S
            self._tb = SummaryWriter(str(self.path.parent / "tensorboard"), purge_step=purge,
                                     flush_secs=TB_FLUSH_S)
            self._summary = Summary
        except ImportError:  # tensorboard is optional
            pass

    def write(self, row: dict) -> None:
        self._f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            # One event per row holding all its scalars (as add_scalar would write them, one
            # Summary.Value per tag), not one event per scalar and a flush: those were 47
            # events of a proto, a queue put and two checksums each, and the flush waited for
            # TensorBoard's thread to write them all: 3.4 ms of the trainer's CPU a step on
            # the 2-core machine, spent while the engines generate.
            values = [self._summary.Value(tag=tag, simple_value=value)
                      for tag, value in scalars(row).items()]
            self._tb._get_file_writer().add_summary(self._summary(value=values), row["step"])

    def line(self, row: dict, total_steps: int) -> str:
        """One compact line: learning signal | where the step's time went | throughput."""
        tok_s = row["tokens_generated"] / max(row["generate_s"], 1e-9)
        kl_ref = f"kl_ref {row['kl_ref']:.1e} " if self.kl_ref else ""
        if "kl_teacher" in row:  # on-policy distillation: the reverse KL to the teacher
            kl_ref += f"kl_teacher {row['kl_teacher']:.3f} "
        if "value_loss" in row:  # PPO's critic
            kl_ref += f"vloss {row['value_loss']:.3f} "
        notes = ""  # only when something happened
        if row.get("reward_errors") or row.get("reward_timeouts"):
            notes += (f" | reward errors {row['reward_errors']} timeouts "
                      f"{row['reward_timeouts']}")
        if row.get("ds_rounds", 1) > 1 or row.get("ds_filled_groups"):
            notes += (f" | dyn. sampling rounds {row['ds_rounds']} dropped "
                      f"{row['ds_dropped_groups']} filled {row['ds_filled_groups']}")
        return (f"step {row['step']}/{total_steps} reward {row['reward_mean']:.3f} "
                f"len {row['response_len']:.1f} ent {row['entropy']:.2f} {kl_ref}"
                f"kl_mis {row['mismatch_kl']:.1e} clip {row['clip_frac']:.3f} "
                f"stale {row['staleness_mean']:.1f} | step {row['step_time_s']:.2f}s = "
                f"wait {row['wait_s']:.2f} xfer {row['transfer_s']:.3f}"
                + (f" rm {row['reward_model_s']:.2f}" if "reward_model_s" in row else "") +
                f" train {row['train_s']:.2f} sync {row['sync_s']:.3f}"
                + (f" ckpt {row['checkpoint_s']:.2f}" if row.get("checkpoint_s") else "")
                + (f" other {row['other_s']:.3f}" if "other_s" in row else "") +
                f" | gen {tok_s:.0f} tok/s, train {row['train_tokens_per_s']:.0f} tok/s"
                + notes)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def scalars(row: dict) -> dict[str, float]:
    """The TensorBoard scalars of a metrics row: its numbers (bools as 0/1; NaN stays NaN, a
    diverged loss should show) and, for a dict of numbers, one tag per entry
    (`behaviour_version_by_engine/0`). Strings, lists, None and the step itself (the x axis)
    are left out."""
    out = {}
    for key, value in row.items():
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, v in items:
            if key != "step" and isinstance(v, Real):
                out[key if sub is None else f"{key}/{sub}"] = float(v)
    return out
