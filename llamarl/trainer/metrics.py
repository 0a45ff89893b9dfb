"""metrics.jsonl (one JSON object per trainer step), TensorBoard scalars when tensorboard is
installed (RUN_DIR/tensorboard), and the one-line progress report."""

from __future__ import annotations

import json
from numbers import Real
from pathlib import Path

TB_FLUSH_S = 10  # TensorBoard shows a running job's scalars at most this late


def truncate_after(run_dir: Path, step: int) -> int:
    """Resuming at `step`: drop the rows of metrics.jsonl and eval.jsonl beyond it (they are
    about to be produced again), so each step appears once. Returns the rows dropped."""
    dropped = 0
    for name in ("metrics.jsonl", "eval.jsonl"):
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        keep = []
        for line in path.read_text().splitlines():
            try:
                row_step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):  # a line torn by the crash
                dropped += 1
                continue
            if row_step <= step:
                keep.append(line)
            else:
                dropped += 1
        path.write_text("".join(x + "\n" for x in keep))
    return dropped


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
