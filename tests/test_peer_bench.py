"""bench/peer_trl.py's training time: evaluations are not training time, for both trainers
alike. llamarl's engine evaluates step s's weights in the trainer's wait for batch s + 1, so
step 0's evaluation sits in step 1's row; TRL's runs before its clock starts."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def peer_trl():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("peer_trl", BENCH / "peer_trl.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def _run_dir(tmp_path: Path, step_s: dict, evals: dict) -> Path:
    rows = [{"step": s, "step_time_s": t, "tokens_generated": 100, "generate_s": 1.0,
             "wait_s": 1.0, "train_s": t - 1.0, "peak_rss_mib": 10.0}
            for s, t in step_s.items()]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.jsonl").write_text("".join(
        json.dumps({"step": s, "eval_s": e, "reward_mean": r}) + "\n"
        for s, (e, r) in evals.items()))
    return tmp_path


def test_evaluations_are_not_training_time(peer_trl, tmp_path):
    # steps of 10 s; evaluations of 3 s (step 0, in step 1) and 2 s (step 2, in step 3)
    run = _run_dir(tmp_path, {1: 13.0, 2: 10.0, 3: 12.0, 4: 10.0},
                   {0: (3.0, 0.1), 2: (2.0, 0.3), 4: (5.0, 0.6)})
    out = peer_trl.llamarl_summary(run, thresholds=(0.5,))
    assert out["steps_to_0.5"] == 4
    assert out["time_to_0.5"] == pytest.approx(40.0)  # the four steps alone
    assert out["time_to_0.5_with_evals"] == pytest.approx(42.0)  # + step 2's evaluation
    assert dict(out["train_time_at"]) == pytest.approx({0: 0.0, 2: 20.0, 4: 40.0})


def test_trl_evaluation_draws_a_stream_per_seed(peer_trl):
    # every (seed, step) of a 30-step, 5-seed comparison its own stream; seed 0 the old one
    seeds = {peer_trl.trl_eval_seed(seed, step) for seed in range(5) for step in range(31)}
    assert len(seeds) == 5 * 31
    assert [peer_trl.trl_eval_seed(0, s) for s in (0, 5, 20)] == [7919, 7924, 7939]
