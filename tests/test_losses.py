"""The 2025-26 policy losses against values worked out by hand: clip-higher, GSPO, CISPO and
masked importance sampling (token, sequence, geometric), plus the registry's own checks."""

from __future__ import annotations

import math

import pytest
import torch

from llamarl.algorithms.policy_loss import policy_loss
from llamarl.config import AlgorithmConfig


def run(log_ratios, adv, cfg, agg="token_mean", norm=None):
    """log_ratios: per token of each sequence (all sampled); behaviour logp 0, so logp is the
    log ratio. Returns (loss, d loss / d logp, stats)."""
    logp = torch.tensor(log_ratios, dtype=torch.float32, requires_grad=True)
    mask = torch.ones_like(logp)
    cfg.loss_agg = agg
    n = norm if norm is not None else (mask.sum() if agg == "token_mean" else logp.shape[0])
    loss, stats = policy_loss(logp, torch.zeros_like(logp), torch.tensor(adv), mask, cfg,
                              float(n))
    loss.backward()
    return float(loss.detach()), logp.grad.tolist(), stats


def test_clip_higher_raises_only_the_upper_bound():
    lr = [[math.log(1.25)], [math.log(0.75)]]
    # symmetric 0.2: -min(1.25, 1.2) and -min(-0.75, -0.8) -> (-1.2 + 0.8) / 2
    loss, grad, stats = run(lr, [1.0, -1.0], AlgorithmConfig(clip_eps=0.2))
    assert loss == pytest.approx((-1.2 + 0.8) / 2)
    assert grad == [[0.0], [0.0]] and float(stats["corrected"]) == 2
    # clip-higher 0.28: 1.25 is inside [0.8, 1.28]: -1.25, gradient -1.25 / 2
    loss, grad, stats = run(lr, [1.0, -1.0], AlgorithmConfig(clip_eps=0.2, clip_eps_high=0.28))
    assert loss == pytest.approx((-1.25 + 0.8) / 2)
    assert grad[0][0] == pytest.approx(-1.25 / 2) and grad[1] == [0.0]
    assert float(stats["corrected"]) == 1


def test_gspo_uses_the_length_normalised_sequence_ratio():
    cfg = AlgorithmConfig(name="gspo", clip_eps=0.2)
    # sequence 1: s = exp((0.1 + 0.3) / 2) = 1.2214 > 1.2, A = 1 -> clipped: -1.2, no gradient
    # sequence 2: s = exp(0) = 1, A = 2 -> -2; d/d logp_t = -A s / |y| = -1 on each token
    loss, grad, stats = run([[0.1, 0.3], [0.05, -0.05]], [1.0, 2.0], cfg,
                            agg="seq_mean_token_mean")
    assert loss == pytest.approx((-1.2 + -2.0) / 2)
    assert grad[0] == [0.0, 0.0]
    assert grad[1] == pytest.approx([-0.5, -0.5])  # -1 per token, / 2 sequences
    assert float(stats["corrected"]) == 2  # both tokens of sequence 1


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    cfg = AlgorithmConfig(name="cispo", clip_eps=0.2)
    # rho = 1.5 -> weight sg(clip) = 1.2; l = -1.2 * A * logp, A = 2: gradient -2.4 (PPO
    # clip would give 0); rho = 1 -> weight 1, gradient -A = -2
    lr = [[math.log(1.5), 0.0]]
    loss, grad, stats = run(lr, [2.0], cfg, norm=1.0)
    assert loss == pytest.approx(-1.2 * 2 * math.log(1.5))
    assert grad[0] == pytest.approx([-2.4, -2.0])
    assert float(stats["corrected"]) == 1
    _, ppo_grad, _ = run(lr, [2.0], AlgorithmConfig(clip_eps=0.2), norm=1.0)
    assert ppo_grad[0][0] == 0.0


@pytest.mark.parametrize("level, kept", [("token", [True, True]), ("sequence", [False, True]),
                                         ("geometric", [True, True])])
def test_masked_importance_sampling_levels(level, kept):
    # sequence 1: token ratios e^0.5 = 1.65 (inside [0.5, 2]), product e^1 = 2.72 (outside),
    # geometric mean e^0.5 (inside); sequence 2: ratios 1
    cfg = AlgorithmConfig(correction="mis", mis_level=level, mis_low=0.5, mis_high=2.0,
                          clip_eps=0.8)
    loss, grad, stats = run([[0.5, 0.5], [0.0, 0.0]], [1.0, 1.0], cfg, norm=4.0)
    r = math.exp(0.5)
    expected = (-(2 * r) * kept[0] - 2.0 * kept[1]) / 4  # ppo clip inside [0.2, 1.8]
    assert loss == pytest.approx(expected)
    assert float(stats["corrected"]) == 2 * (not kept[0])
    assert (grad[0][0] != 0) == kept[0]


def test_mis_at_token_level_masks_single_tokens():
    cfg = AlgorithmConfig(correction="mis", mis_level="token", mis_low=0.5, mis_high=2.0)
    _, grad, stats = run([[math.log(3.0), 0.0]], [1.0], cfg, norm=2.0)
    assert grad[0][0] == 0.0 and grad[0][1] != 0.0 and float(stats["corrected"]) == 1


def test_registry_names_are_validated_once():
    from llamarl.config import load_config
    from llamarl.registry.algorithms import ALGORITHMS

    for name in ALGORITHMS:  # (distillation needs its teacher named)
        load_config(None, [f"algorithm.name={name}"] + (
            ["algorithm.teacher_path=tiny-grpo:reverse"] if name == "on_policy_distill" else []))
    with pytest.raises(ValueError, match="algorithm.name.*gspo"):
        load_config(None, ["algorithm.name=gspoo"])
    with pytest.raises(ValueError, match="algorithm.policy_loss.*'module:function'"):
        load_config(None, ["algorithm.policy_loss=nope"])
    with pytest.raises(ValueError, match="both choose the policy loss"):
        load_config(None, ["algorithm.policy_loss=cispo", "algorithm.correction=tis"])
    with pytest.raises(ValueError, match="cannot be imported"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1),
                    AlgorithmConfig(policy_loss="no_such_module:fn"), 1.0)
