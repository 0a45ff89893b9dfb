import json
import subprocess
import sys

import pytest
from conftest import ROOT

from llamarl import timeline
from llamarl.plot import busy_share, chrome_trace, kl_panels, latest_per_step, trainer_window
from llamarl.timeline import Timeline, read


def test_timeline_roundtrip_trace_and_busy_share(tmp_path):
    tl = Timeline(tmp_path, 0, "trainer 0")
    tl.record("wait_rollouts", 100.0, 101.0, 0)
    tl.record("train", 101.0, 102.0, 0)
    tl.close()
    Timeline(tmp_path, 1, "generator 0").record("generate", 100.5, 101.5, 0)
    events = read(tmp_path)
    assert len(events) == 3
    trace = chrome_trace(events)
    train = next(e for e in trace["traceEvents"] if e["name"] == "train")
    assert train["ts"] == 1_000_000 and train["dur"] == 1_000_000 and train["tid"] == 0
    share = busy_share(events)
    assert share["rank 0 (trainer 0)"] == 0.5  # waiting is not work
    assert share["rank 1 (generator 0)"] == 1.0


def fake_launch(run_dir, t0: float, steps: range, kl_ref: float) -> None:
    """What one launch of a 2-trainer, 1-engine run logs: per trainer step, the generator's
    generate (1 s) overlapping the trainers' wait, then train (1 s), sync and checkpoint."""
    trainers = [Timeline(run_dir, r, f"trainer {r}") for r in (0, 1)]
    gen = Timeline(run_dir, 2, "generator 0")
    with open(run_dir / "metrics.jsonl", "a") as metrics:
        for i, step in enumerate(steps):
            t = t0 + 3.0 * i
            gen.record("generate", t, t + 1.0, step)
            for tl in trainers:
                tl.record("wait_rollouts", t, t + 1.0, step)
                tl.record("train", t + 1.0, t + 2.0, step)
                tl.record("sync", t + 2.0, t + 2.1, step)
                tl.record("checkpoint", t + 2.1, t + 2.2, step)
            metrics.write(json.dumps({"step": step + 1, "reward_mean": 0.1 * step + t0 / 1e4,
                                      "mismatch_kl": 1e-9, "kl_ref": kl_ref * step}) + "\n")
    for tl in [*trainers, gen]:
        tl.close()


def resumed_run(tmp_path):
    """Launch 1 runs steps 0-1 and dies; launch 2 (100 s later) resumes and runs steps 1-3."""
    fake_launch(tmp_path, 1000.0, range(0, 2), kl_ref=0.01)
    fake_launch(tmp_path, 1100.0, range(1, 4), kl_ref=0.01)
    return tmp_path


def test_chrome_trace_has_one_named_track_per_rank_and_complete_events(tmp_path):
    trace = json.loads(json.dumps(chrome_trace(read(resumed_run(tmp_path)))))
    phases = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(phases) == 5 * 2 * 4 + 5 * 1  # 5 steps logged x (2 trainers x 4 phases + 1 gen)
    for e in phases:
        assert set(e) >= {"name", "ph", "ts", "dur", "pid", "tid"}
        assert e["ts"] >= 0 and e["dur"] >= 0 and e["pid"] == 0
    assert {e["name"] for e in phases} == {"generate", "wait_rollouts", "train", "sync",
                                           "checkpoint"}
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "0: trainer 0", 1: "1: trainer 1", 2: "2: generator 0"}
    assert {e["tid"] for e in phases} == set(names)
    first_train = min((e for e in phases if e["name"] == "train"), key=lambda e: e["ts"])
    assert first_train["ts"] == pytest.approx(1e6) and first_train["dur"] == pytest.approx(1e6)


def test_a_resumed_run_charts_its_latest_launch_and_latest_rows(tmp_path):
    run = resumed_run(tmp_path)
    lo, hi, n = trainer_window(read(run), steps=6)
    assert (lo, hi, n) == (1100.0, pytest.approx(1108.2), 3)  # launch 2 only: steps 1, 2, 3
    lo, hi, n = trainer_window(read(run), steps=2)
    assert (lo, n) == (1103.0, 2)
    rows = latest_per_step(timeline.read_jsonl(run / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[1]["reward_mean"] == pytest.approx(0.1 + 0.11)  # step 2 as launch 2 ran it
    (ref_label, ref), (mis_label, _) = kl_panels(rows)
    assert "reference" in ref_label and "mismatch" in mis_label
    assert ref == pytest.approx([0.0, 0.01, 0.02, 0.03])
    assert [label for label, _ in kl_panels([{"step": 1, "kl_ref": 0.0,
                                              "mismatch_kl": 0.0}])] == [mis_label]


def test_plot_command_writes_the_charts_and_the_trace(tmp_path):
    pytest.importorskip("matplotlib")
    run = resumed_run(tmp_path)
    (run / "eval.jsonl").write_text("".join(json.dumps(
        {"step": s, "reward_mean": 0.3, "reward_mean_greedy": 0.4}) + "\n" for s in (0, 2, 4)))
    with open(run / "timeline" / "rank0.jsonl", "a") as f:
        f.write('{"rank": 0, "role": "trainer 0", "pha')  # a rank killed mid-line
    proc = subprocess.run([sys.executable, "-m", "llamarl.plot", str(run)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "skipped the broken line 21" in proc.stderr
    for name in ("reward.png", "timeline.png"):
        with open(run / "plots" / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    trace = json.loads((run / "plots" / "timeline.trace.json").read_text())
    assert len([e for e in trace["traceEvents"] if e["ph"] == "X"]) == 45
    assert "rank 2 (generator 0): busy" in proc.stdout
