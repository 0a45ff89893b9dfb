"""MetricsLog: metrics.jsonl, TensorBoard scalars (read back), and the one-line progress report."""

from __future__ import annotations

import json
import sys

import pytest

from llamarl.trainer.metrics import MetricsLog, scalars


def make_row(step: int, **extra) -> dict:
    row = {"step": step, "policy_version": step, "reward_mean": 0.5 + 0.1 * step, "loss": -0.25,
           "response_len": 5.5, "entropy": 1.234, "kl_ref": 0.00123, "mismatch_kl": 2e-9,
           "clip_frac": 0.0626, "staleness_mean": 0.5, "step_time_s": 1.5, "wait_s": 0.75,
           "transfer_s": 0.0126, "train_s": 0.5, "sync_s": 0.125, "other_s": 0.1124,
           "tokens_generated": 1000,
           "generate_s": 0.5, "train_tokens_per_s": 4000.0,
           # non-scalars as the trainer writes them: must not break the TensorBoard writer
           "batch_digest": "3f2a9c0d11aa", "behaviour_version_by_engine": {"0": 2, "1": 1},
           "skipped_step": True, "note": None, "ranks": [0, 1]}
    row.update(extra)
    return row


def test_progress_line_has_every_field_of_the_issue(tmp_path):
    row = make_row(3)
    logs = [MetricsLog(tmp_path / name / "metrics.jsonl", kl_ref=name == "ref")
            for name in ("plain", "ref")]
    plain, with_ref = (log.line(row, 10) for log in logs)
    for log in logs:
        log.close()
    # gen tok/s = 1000 tokens / 0.5 s; kl_ref shown only when a reference policy is loaded
    assert with_ref == ("step 3/10 reward 0.800 len 5.5 ent 1.23 kl_ref 1.2e-03 kl_mis 2.0e-09 "
                        "clip 0.063 stale 0.5 | step 1.50s = wait 0.75 xfer 0.013 train 0.50 "
                        "sync 0.125 other 0.112 | gen 2000 tok/s, train 4000 tok/s")
    assert plain == with_ref.replace("kl_ref 1.2e-03 ", "")


def test_scalars_flatten_dicts_and_skip_what_is_not_a_number():
    got = scalars(make_row(2, loss=float("nan")))
    assert got["behaviour_version_by_engine/0"] == 2.0
    assert got["behaviour_version_by_engine/1"] == 1.0
    assert got["skipped_step"] == 1.0  # a bool counts as 0/1
    assert got["loss"] != got["loss"]  # NaN is kept: a diverged loss must show
    for left_out in ("step", "batch_digest", "note", "ranks", "behaviour_version_by_engine"):
        assert left_out not in got


def test_tensorboard_scalars_read_back_equal_the_rows(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path / "metrics.jsonl")
    rows = [make_row(1), make_row(2)]
    for row in rows:
        log.write(row)
    log.close()
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == rows
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == set(scalars(rows[0]))
    for tag in ("reward_mean", "kl_ref", "train_tokens_per_s", "behaviour_version_by_engine/0"):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [1, 2]
        assert [e.value for e in events] == pytest.approx([scalars(r)[tag] for r in rows])


def test_without_tensorboard_only_metrics_jsonl_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import -> ImportError
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write(make_row(1))
    log.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 1
    assert not (tmp_path / "tensorboard").exists()


def test_resume_truncates_rows_after_the_checkpoint(tmp_path):
    from llamarl.runtime.run_dir import truncate_after

    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "rew')
    (tmp_path / "eval.jsonl").write_text(
        "".join(json.dumps({"step": s}) + "\n" for s in (0, 2, 4)))
    samples = tmp_path / "samples"
    samples.mkdir()
    (samples / "train.jsonl").write_text(
        "".join(json.dumps({"step": s, "kind": "train"}) + "\n" for s in (1, 1, 2, 3)))
    for s in (0, 2, 4):
        (samples / f"eval_{s}.jsonl").write_text(json.dumps({"step": s}) + "\n")
    assert truncate_after(tmp_path, 2) == 4  # steps 3, 4, the torn line, eval step 4
    rows = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(x)["step"] for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert rows == [1, 2] and evals == [0, 2]
    train = [json.loads(x)["step"] for x in (samples / "train.jsonl").read_text().splitlines()]
    assert train == [1, 1, 2]
    assert sorted(p.name for p in samples.glob("eval_*")) == ["eval_0.jsonl", "eval_2.jsonl"]
