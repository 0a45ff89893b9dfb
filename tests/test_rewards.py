import os
import time
from pathlib import Path

import pytest

from llamarl.config import RewardConfig
from llamarl.rewards.registry import resolve_builtin
from llamarl.rewards.sandbox import KILL_GRACE_S
from llamarl.rewards.scorer import RewardScorer, reward_metrics
from llamarl.tiny.task import reverse_reward, sample_examples

TESTS = str(Path(__file__).parent)


def test_reverse_reward_by_hand():
    assert reverse_reward("cba", "cba") == 1.0
    assert reverse_reward("cbx", "cba") == pytest.approx(2 / 3)
    assert reverse_reward("cbaaa", "cba") == pytest.approx(3 / 5)  # rambling is penalised
    assert reverse_reward("", "cba") == 0.0


def test_held_out_split_is_disjoint_from_train():
    train = {e.prompt for e in sample_examples(5000, "train", 0)}
    held = {e.prompt for e in sample_examples(300, "eval", 0)}
    assert not train & held
    assert all(e.answer == e.prompt[:-1][::-1] for e in sample_examples(10, "eval", 0))


def scorer(monkeypatch, functions, weights=(), **kw) -> RewardScorer:
    monkeypatch.syspath_prepend(TESTS)  # the spawned worker inherits sys.path
    s = RewardScorer(RewardConfig(functions=list(functions), weights=list(weights), **kw), 16)
    return s


def test_weighted_builtin_and_user_functions(monkeypatch):
    s = scorer(monkeypatch, ["reverse_match", "user_rewards:length_bonus"], [1.0, 0.5])
    try:
        out = s.score(["abc=", "abc="], ["cba", "c"], ["cba", "cba"])
    finally:
        s.close()
    # sample 0: 1 + 0.5 * 1;  sample 1: reverse 1/3 + 0.5 * length 1/3
    assert out.totals == pytest.approx([1.5, 0.5])
    assert out.components["user_rewards:length_bonus"] == pytest.approx([1.0, 1 / 3])


def test_user_functions_run_in_another_process(monkeypatch):
    s = scorer(monkeypatch, ["user_rewards:worker_pid"])
    try:
        pids = s.score(["p"] * 3, ["a", "b", "c"], ["x"] * 3).totals
    finally:
        s.close()
    assert len(set(pids)) == 1 and pids[0] != os.getpid()


def test_unknown_reward_names_the_fix(monkeypatch):
    with pytest.raises(ValueError, match="reverse_match"):
        resolve_builtin("no_such_reward", "")
    with pytest.raises(ValueError, match="cannot be imported"):
        scorer(monkeypatch, ["no_such_module:fn"])


def test_raising_reward_names_function_and_sample(monkeypatch):
    s = scorer(monkeypatch, ["user_rewards:broken"])
    try:
        with pytest.raises(RuntimeError, match="user_rewards:broken.*ZeroDivisionError.*'abc='"):
            s.score(["abc="], ["x"], ["cba"])
    finally:
        s.close()


def test_on_error_zero_scores_zero_and_counts(monkeypatch):
    s = scorer(monkeypatch, ["user_rewards:not_a_number", "exact_match"], on_error="zero")
    try:
        out = s.score(["p"] * 3, ["n", "ok", "cba"], ["cba"] * 3)
    finally:
        s.close()
    # not_a_number: None (error) for "n", 0.5 otherwise; exact_match: 1 for "cba" only
    assert out.totals == pytest.approx([0.0, 0.5, 1.5])
    assert (out.errors, out.timeouts) == (1, 0)


def test_soft_timeout_interrupts_the_call_and_keeps_the_worker(monkeypatch):
    s = scorer(monkeypatch, ["user_rewards:sleepy"], on_error="zero", timeout_s=0.3)
    try:
        t0 = time.monotonic()
        out = s.score(["p"] * 4, ["a", "s1", "b", "s2"], ["x"] * 4)
        elapsed = time.monotonic() - t0
        assert out.totals == [1.0, 0.0, 1.0, 0.0] and out.timeouts == 2
        assert elapsed < 2 * 0.3 + 1.5, elapsed
        assert s.worker.restarts == 0  # SIGALRM ended the sleeps; no kill needed
    finally:
        s.close()


def test_hard_timeout_kills_and_restarts_the_worker(monkeypatch):
    s = scorer(monkeypatch, ["user_rewards:stubborn", "user_rewards:length_bonus"],
               on_error="zero", timeout_s=0.3)
    try:
        t0 = time.monotonic()
        out = s.score(["p"] * 3, ["a", "s", "b"], ["x"] * 3)
        elapsed = time.monotonic() - t0
        # stubborn: 2 except the stuck call; length_bonus: 1 for every one-letter completion
        assert out.components["user_rewards:stubborn"] == [2.0, 0.0, 2.0]
        assert out.components["user_rewards:length_bonus"] == [1.0, 1.0, 1.0]
        assert out.timeouts == 1 and s.worker.restarts == 1
        assert elapsed < 0.3 + KILL_GRACE_S + 15, elapsed  # + a worker restart
        assert s.score(["p"], ["a"], ["x"]).totals == [3.0]  # the new worker works
    finally:
        s.close()


def test_a_crashing_worker_is_an_error_and_is_restarted(monkeypatch):
    s = scorer(monkeypatch, ["user_rewards:crashes"], on_error="zero")
    try:
        out = s.score(["p"] * 3, ["a", "x", "b"], ["y"] * 3)
        assert out.totals == [3.0, 0.0, 3.0] and out.errors == 1
    finally:
        s.close()
    s = scorer(monkeypatch, ["user_rewards:crashes"])  # on_error = stop
    try:
        with pytest.raises(RuntimeError, match=r"crashes. ended the reward worker .*code 3"):
            s.score(["p"], ["x"], ["y"])
    finally:
        s.close()


def test_timeout_with_stop_names_the_function(monkeypatch):
    s = scorer(monkeypatch, ["user_rewards:sleepy"], timeout_s=0.2)
    try:
        with pytest.raises(RuntimeError, match="'user_rewards:sleepy' timed out after 0.2 s"):
            s.score(["p"], ["s"], ["x"])
    finally:
        s.close()


def test_overlong_penalty_only_with_lengths():
    s = RewardScorer(RewardConfig(functions=["exact_match"], overlong_buffer=4,
                                  overlong_penalty=1.0), max_new_tokens=20)
    out = s.score(["p"] * 3, ["a", "a", "b"], ["a"] * 3, lengths=[10, 18, 20])
    assert out.totals == pytest.approx([1.0, 0.5, -1.0])  # 1 + 0, 1 - 0.5, 0 - 1
    assert s.score(["p"], ["a"], ["a"]).totals == [1.0]  # evaluation: no shaping


def test_reward_metrics_sum_counts_over_engines():
    infos = [{"reward_errors": 1, "reward_timeouts": 0, "ds_rounds": 2, "ds_dropped_groups": 3,
              "ds_filled_groups": 0, "reward_components": {"gsm8k": 0.5}},
             {"reward_errors": 2, "reward_timeouts": 1, "ds_rounds": 1, "ds_dropped_groups": 0,
              "ds_filled_groups": 1, "reward_components": {"gsm8k": 0.25}}]
    assert reward_metrics(infos) == {"reward_errors": 3, "reward_timeouts": 1,
                                     "ds_dropped_groups": 3, "ds_filled_groups": 1,
                                     "ds_rounds": 2, "reward/gsm8k": 0.375}
