"""Continuous generation (generator.mode: continuous): weights loaded between two engine steps
while sequences run, each token tagged with the version that sampled it; and the whole loop
end to end with two engines."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import DIST, ROOT, child_env, torchrun
from test_async_e2e import SMALL, SOLO, metrics_of

from llamarl.buffer.record import RolloutBatch, Sample
from llamarl.config import load_config
from llamarl.generator.engine import Completion

RECIPE = "recipes/tiny_grpo_cpu.yaml"
CONTINUOUS = ["generator.mode=continuous", "sync.max_staleness=2"]


def test_a_completion_sampled_by_two_versions_becomes_two_segments_of_one_turn():
    s = Sample()
    s.add_context([1, 2, 3])
    s.add_completion(Completion([5, 6, 7], [-0.1, -0.2, -0.3], "stop", "", [(2, 4), (1, 5)]), 9)
    batch = RolloutBatch.from_samples([s], [1.0], [0], 0)
    assert batch.token_version.tolist() == [-1, -1, -1, 4, 4, 5]
    assert batch.policy_version.tolist() == [4] and batch.turns.tolist() == [1]
    plain = Sample()  # a batch-mode completion: every token by the call's version
    plain.add_completion(Completion([5], [-0.1], "stop", ""), 9)
    assert plain.versions == [9]


def test_a_group_starts_from_fresh_weights_while_the_trainer_has_work():
    """sync.prefer_fresh in continuous mode: a group for batch 10 at k = 2 may start from
    version 8 (the bound) only when the trainer has nothing of this engine queued; while it
    has, the group waits for version 9, the one the trainer publishes before taking batch 9.
    Without prefer_fresh every group started at the bound, k versions old."""
    from llamarl.generator.continuous import admits

    queued, idle = (lambda: True), (lambda: False)
    assert not admits(7, 10, 2, 1, True, idle)  # older than the bound: never
    assert not admits(8, 10, 2, 1, True, queued)  # the trainer has work: wait for 9
    assert admits(8, 10, 2, 1, True, idle)  # it would wait: the bound is allowed
    assert admits(9, 10, 2, 1, True, queued)
    assert admits(8, 10, 2, 1, False, queued)  # prefer_fresh off: at the bound
    # sync.every = 2: the trainer publishes only even versions, so 8 is the freshest
    assert admits(8, 10, 2, 2, True, queued)


def test_an_engine_behind_the_trainer_stops_holding_back_for_k_batches():
    """AheadOfTrainer (prefer_fresh in continuous mode): once a batch ships and finds none of
    the engine's queued (the trainer was about to wait for it), the engine samples at the
    bound for its next k batches; k batches shipped ahead of the trainer, it holds back
    again."""
    from llamarl.generator.continuous import AheadOfTrainer

    ahead = AheadOfTrainer(k=2)
    assert ahead.keeps()  # from the start
    ahead.shipped(found_queued=True)
    assert ahead.keeps()
    ahead.shipped(found_queued=False)
    assert not ahead.keeps()
    ahead.shipped(found_queued=True)
    assert not ahead.keeps()
    ahead.shipped(found_queued=True)
    assert ahead.keeps()


def test_a_batch_ships_complete_groups_oldest_first_without_leaving_one_past_its_deadline():
    """pick_batch: complete groups ship in completion order among those of an age (a short
    response overtakes a long one), but never so that a running group, or the groups older
    than it, could no longer ship by their deadline (start version + k)."""
    from llamarl.generator.continuous import pick_batch

    # k = 2, 2 groups a batch. Batch 1: groups 0-3 started at version 0, 4-5 at version 1.
    started = {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1}
    assert pick_batch({4: 1}, started, 1, 2, 2) is None  # not enough complete groups
    # 0, 1 and 3 still run: any two complete groups leave three version-0 groups for batch 2
    assert pick_batch({2: 0, 4: 1, 5: 1}, started, 1, 2, 2) is None
    # the oldest complete ones go first, and then 0, 1, 4 and 5 fit batches 2 and 3
    assert pick_batch({3: 0, 2: 0, 5: 1}, started, 1, 2, 2) == [2, 3]
    # at k = 3 the version-0 groups have until batch 3: the short ones may ship now
    assert pick_batch({4: 1, 5: 1}, {0: 0, 1: 0, 4: 1, 5: 1}, 1, 3, 2) == [4, 5]
    # a batch at the deadline of a running group waits for it, whatever else is complete
    assert pick_batch({1: 1, 2: 1, 3: 2}, {0: 0, 1: 1, 2: 1, 3: 2}, 2, 2, 2) is None
    assert pick_batch({0: 0, 1: 1, 2: 1}, {0: 0, 1: 1, 2: 1, 3: 2}, 2, 2, 2) == [0, 1]


@pytest.mark.parametrize("overrides, message", [
    (["generator.mode=continuous"], "sync.max_staleness >= 1"),
    (CONTINUOUS + ["sync.deterministic=true"], "generator.mode=batch"),
    (CONTINUOUS + ["rollout.source=user_envs:NoSuchSource"], "built-in sources"),
    (CONTINUOUS + ["generator.in_flight_sequences=3"], "at least one prompt group"),
])
def test_continuous_mode_config_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(RECIPE, overrides)


def _in_flight(model_dir, kv: str) -> dict:
    proc = subprocess.run([sys.executable, str(DIST / "engine_in_flight.py"), str(model_dir),
                           kv], cwd=ROOT, env=child_env(OMP_NUM_THREADS=2),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tokens_sampled_after_an_in_flight_update_match_the_new_weights(tiny_model_dir):
    """recompute: after the load every running sequence is re-prefilled by the new weights,
    so the logprobs the engine returns for later tokens are the trainer's under version 1."""
    out = _in_flight(tiny_model_dir, "recompute")
    assert out["finished"] == 34 and out["running_at_load"] > 0
    # samples aborted (those not finished yet) leave the engine and never come back
    assert out["aborted"] == out["alive_at_abort"] > 0 and out["finished_after_abort"] == 0
    assert out["spanning"] > 0 and out["versions"] == [0, 1], out
    assert out["max_abs_diff"]["0"] <= 1e-3 and out["max_abs_diff"]["1"] <= 1e-3, out
    assert out["recomputed_tokens"] > 0
    # keep (PipelineRL): later tokens attend to KV of the old weights, and it shows
    kept = _in_flight(tiny_model_dir, "keep")
    assert kept["spanning"] > 0 and kept["recomputed_tokens"] == 0
    assert kept["max_abs_diff"]["1"] > 10 * max(out["max_abs_diff"]["1"], 1e-4), (out, kept)


@pytest.mark.slow
def test_two_engines_generate_continuously(tmp_path, cache_dir):
    """Two engines in continuous mode, with generator.dynamic_sampling: at T = 0.05 a group's
    8 samples are nearly always identical, so most groups finish uninformative and are dropped
    as they finish (ds_dropped_groups), the batch waits for later ones, and after
    max_sampling_rounds batches' worth of dropped groups the rest fill it, so the run never
    stalls."""
    proc = torchrun(4, ["-m", "llamarl.launch", RECIPE, "run.steps=6", "generator.engines=2",
                        *CONTINUOUS, "algorithm.correction=aipo", SOLO, "run.eval_every=3",
                        "generator.temperature=0.05", "generator.dynamic_sampling=true",
                        "generator.max_sampling_rounds=2",
                        f"run.output_dir={tmp_path}", *[a for a in SMALL if "eval_every" not in a]],
                    timeout=900, LLAMARL_CACHE=cache_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run, rows = metrics_of(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:
        assert r["staleness_max"] <= 2 and r["dropped_stale"] == 0
        assert 0 < r["engine_busy_share"] <= 1 and r["in_flight_mean"] > 0
        assert 0 <= r["engine_due_share"] <= r["engine_busy_share"]
        assert r["stale_groups_discarded"] == 0  # a group is never left past its deadline
        assert 0 <= r["spanning_share"] <= 1
        assert set(r["behaviour_version_by_engine"]) == {"0", "1"}
    assert rows[-1]["behaviour_version_by_engine"]["0"] >= 2
    assert sum(r["ds_dropped_groups"] for r in rows) > 0, rows
    # per batch at most max_sampling_rounds x prompts_per_step (8) dropped, over both engines
    assert all(0 <= r["ds_dropped_groups"] <= 2 * 8 for r in rows), rows
    # (whether a sample here spans a load depends on timing: the engine-level test above
    # makes it happen and checks the versions and logprobs)
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 3, 6]
    # samples to read: each batch of slot 0 (run.samples_per_step, default 4), each evaluation
    train = [json.loads(x) for x in (run / "samples" / "train.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in train]  # (batches made ahead of the last step come after)
    assert steps[:24] == [s for s in range(1, 7) for _ in range(4)]
    assert all(s > 6 for s in steps[24:]) and steps == sorted(steps)
    assert sorted(p.name for p in (run / "samples").glob("eval_*")) == [
        "eval_0.jsonl", "eval_3.jsonl", "eval_6.jsonl"]


# multi-turn episodes in continuous mode: tests/test_tp.py (with a tp 2 engine, whose other
# rank follows every call)
