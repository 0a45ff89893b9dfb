"""End to end: rewards from a reward model, a user function that raises and hangs (scored zero
and counted), the overlong penalty and dynamic sampling, through the real launcher; and the
reward model scored FSDP2-sharded on the trainer ranks (reward.model_placement=trainer)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, child_env

pytestmark = pytest.mark.slow


def test_reward_model_user_errors_and_dynamic_sampling(tmp_path, cache_dir,
                                                       tiny_reward_model_dir):
    # T = 0.05: the 8 samples of a prompt are nearly always identical, so dynamic sampling
    # drops most groups and has to draw again (max 2 rounds), then fill. `flaky` fails by call
    # count, not by content: weight 0 keeps it from making identical samples' rewards differ.
    cmd = [sys.executable, "-m", "llamarl.launch", "recipes/tiny_grpo_cpu.yaml", "run.steps=3",
           f"run.output_dir={tmp_path}", "generator.prompts_per_step=8", "data.eval_prompts=16",
           "run.eval_every=0", "generator.temperature=0.05",
           "reward.functions=[reverse_match,user_rewards:flaky]", "reward.weights=[1.0,0.0]",
           "reward.on_error=zero", "reward.timeout_s=0.3",
           f"reward.model_path={tiny_reward_model_dir}", "reward.model_weight=0.1",
           "reward.overlong_buffer=4", "reward.overlong_penalty=0.5",
           "generator.dynamic_sampling=true", "generator.max_sampling_rounds=2"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=child_env(LLAMARL_CACHE=cache_dir, PYTHONPATH=Path(__file__).parent))
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-5000:]
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # every scored call counts, kept or dropped: 1 hang per 50 calls, 7 errors per 50
    assert sum(r["reward_timeouts"] for r in rows) >= 1
    assert sum(r["reward_errors"] for r in rows) >= 7
    assert all(r["ds_rounds"] in (1, 2) for r in rows)
    assert sum(r["ds_dropped_groups"] + r["ds_filled_groups"] for r in rows) > 0
    for r in rows:
        for key in ("reward/reverse_match", "reward/user_rewards:flaky", "reward/reward_model",
                    "reward/overlong"):
            assert key in r, key
        assert r["reward/reward_model"] != 0.0
    assert "reward errors" in proc.stderr
    print(f"reward e2e run: {elapsed:.1f} s; rows: "
          f"{[{k: v for k, v in r.items() if k.startswith(('reward', 'ds_'))} for r in rows]}")



def test_reward_model_on_the_trainer_ranks(tmp_path, cache_dir, tiny_reward_model_dir):
    # reward.model_placement=trainer: the generator scores reverse_match only, the two trainer
    # ranks score the reward model FSDP2-sharded and add 0.1 x its score before the update.
    cmd = [sys.executable, "-m", "llamarl.launch", "recipes/tiny_grpo_cpu.yaml", "run.steps=3",
           f"run.output_dir={tmp_path}", "generator.prompts_per_step=8", "data.eval_prompts=16",
           "run.eval_every=0", f"reward.model_path={tiny_reward_model_dir}",
           "reward.model_weight=0.1", "reward.model_placement=trainer"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=child_env(LLAMARL_CACHE=cache_dir))
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "sharded over 2 trainer rank(s)" in proc.stderr
    assert "eval.jsonl holds the reward functions' held-out reward only" in proc.stderr
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["reward/reward_model"] != 0.0 and r["reward_model_s"] > 0
        # on-policy, nothing dropped: the trained reward is the function's plus the model's
        assert r["reward_mean"] == pytest.approx(
            r["reward/reverse_match"] + 0.1 * r["reward/reward_model"], abs=1e-5)
    print(f"trainer-placement reward e2e run: {elapsed:.1f} s; reward_model_s "
          f"{[round(r['reward_model_s'], 3) for r in rows]}, train_s "
          f"{[round(r['train_s'], 3) for r in rows]}")
