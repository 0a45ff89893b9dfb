import pytest

from llamarl.rewards.registry import RewardModel, resolve
from llamarl.tiny.task import reverse_reward, sample_examples


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


def test_registry_and_user_functions(monkeypatch):
    monkeypatch.syspath_prepend(__file__.rsplit("/", 1)[0])
    rm = RewardModel(["reverse_match", "user_rewards:length_bonus"], [1.0, 0.5])
    assert rm("cba", "cba", "abc=") == pytest.approx(1.5)


def test_unknown_reward_names_the_fix():
    with pytest.raises(ValueError, match="reverse_match"):
        resolve("no_such_reward")
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve("no_such_module:fn")


def test_raising_reward_names_function_and_sample(monkeypatch):
    monkeypatch.syspath_prepend(__file__.rsplit("/", 1)[0])
    rm = RewardModel(["user_rewards:broken"], [])
    with pytest.raises(RuntimeError, match="user_rewards:broken.*ZeroDivisionError.*'abc='"):
        rm("x", "cba", "abc=")
