"""The reward model: batched scores equal one-at-a-time scores, and it adds with its weight."""

import pytest
from conftest import save_tiny_reward_model

from llamarl.config import RewardConfig
from llamarl.rewards.reward_model import SequenceRewardModel
from llamarl.rewards.scorer import REWARD_MODEL, RewardScorer

TEXTS = ["abc=cba", "a=", "abcdef=fedcba", "ll=", "kji=ijk", "b=b"]


def test_batched_scores_equal_one_by_one_scores(tiny_reward_model_dir):
    rm = SequenceRewardModel(str(tiny_reward_model_dir), "cpu", batch_size=4)
    batched = rm.score(TEXTS)  # two sub-batches, rows padded to different widths
    single = [rm.score([t])[0] for t in TEXTS]
    assert batched == pytest.approx(single, abs=1e-5)
    assert len(set(round(x, 4) for x in batched)) == len(TEXTS)  # real, distinct scores
    assert not any(p.requires_grad for p in rm.model.parameters()) and not rm.model.training


def test_reward_model_is_a_weighted_component(tiny_reward_model_dir):
    rm = SequenceRewardModel(str(tiny_reward_model_dir), "cpu")
    expected = rm.score(["abc=cba", "abc=xyz"])
    cfg = RewardConfig(functions=["exact_match"], model_path=str(tiny_reward_model_dir),
                       model_weight=0.5, model_batch_size=2)
    out = RewardScorer(cfg, 16).score(["abc=", "abc="], ["cba", "xyz"], ["cba", "cba"])
    assert out.components[REWARD_MODEL] == pytest.approx(expected, abs=1e-5)
    assert out.totals == pytest.approx([1 + 0.5 * expected[0], 0.5 * expected[1]], abs=1e-5)


def test_reward_model_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"reward.model_path .*\(no config.json\)"):
        SequenceRewardModel(str(tmp_path), "cpu")
    path = save_tiny_reward_model(tmp_path / "two_labels", num_labels=2)
    with pytest.raises(ValueError, match="num_labels = 2"):
        SequenceRewardModel(str(path), "cpu")


@pytest.mark.gpu
def test_reward_model_on_gpu_matches_cpu(tiny_reward_model_dir):
    cpu = SequenceRewardModel(str(tiny_reward_model_dir), "cpu", batch_size=4).score(TEXTS)
    rm = SequenceRewardModel(str(tiny_reward_model_dir), "cuda", batch_size=4)
    assert next(rm.model.parameters()).is_cuda
    assert rm.score(TEXTS) == pytest.approx(cpu, abs=1e-4)
