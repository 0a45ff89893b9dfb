"""GRPO advantages and every policy loss against values worked out by hand."""

import math

import pytest
import torch

from llamarl.algorithms.advantages import (
    compute_advantages,
    equal_reward_groups,
    group_advantages,
)
from llamarl.algorithms.policy_loss import policy_loss
from llamarl.config import AlgorithmConfig


def test_group_advantages_by_hand():
    # group 7: r = [1, 0] -> mean 0.5, std 0.5 -> A = [1, -1]
    # group 3: r = [0, 0, 3] -> mean 1, std sqrt(2) -> A = [-1/sqrt2, -1/sqrt2, sqrt2]
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0])
    g = torch.tensor([7, 7, 3, 3, 3])
    a = group_advantages(r, g, eps=0.0)
    s = math.sqrt(2)
    assert torch.allclose(a, torch.tensor([1.0, -1.0, -1 / s, -1 / s, s]), atol=1e-6)


def test_all_equal_group_gets_zero_advantage():
    a = group_advantages(torch.tensor([0.5, 0.5, 0.5]), torch.tensor([1, 1, 1]))
    assert torch.equal(a, torch.zeros(3))


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_a_group_of_equal_rewards_that_float32_cannot_average_exactly_gets_zero(name):
    """Eight rewards of 0.9 (or 0.3, 7/11) average to a float32 a few ulps off the value: GRPO
    divided that by std + eps ~ 1e-6 and gave the whole group +-0.056."""
    rewards = torch.tensor([0.9] * 8 + [0.3] * 8 + [7 / 11] * 8 + [0.0] * 4 + [1.0] * 4)
    groups = torch.tensor([0] * 8 + [1] * 8 + [2] * 8 + [3] * 8)
    a = compute_advantages(name, rewards, groups, torch.ones(32))
    assert torch.equal(a[:24], torch.zeros(24)), a[:24]
    assert (a[24:28] < 0).all() and (a[28:] > 0).all()  # the group with a spread still learns
    assert equal_reward_groups(rewards, groups).tolist() == [True] * 24 + [False] * 8


def _example():
    """seq 0 (A = +1): token ratios 1.5 and 1.0; seq 1 (A = -1): one token with ratio 0.5."""
    old = torch.zeros(2, 3)
    logp = torch.tensor([[math.log(1.5), 0.0, 0.0], [math.log(0.5), 0.0, 0.0]],
                        requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    return logp, old, adv, mask


def _run(agg="token_mean", norm=3, **kw):
    logp, old, adv, mask = _example()
    loss, stats = policy_loss(logp, old, adv, mask, AlgorithmConfig(loss_agg=agg, **kw), norm)
    loss.backward()
    grads = [logp.grad[0, 0].item(), logp.grad[0, 1].item(), logp.grad[1, 0].item()]
    return loss.item(), stats, grads


def test_ppo_clip_token_mean_by_hand():
    # per-token: -min(1.5, 1.2) = -1.2 ; -min(1.0, 1.0) = -1.0 ; -min(-0.5, -0.8) = +0.8
    loss, stats, grads = _run(clip_eps=0.2)
    assert loss == pytest.approx((-1.2 - 1.0 + 0.8) / 3)
    assert stats["corrected"].item() == 2.0
    assert stats["ratio_max"].item() == pytest.approx(1.5)
    assert stats["ratio_min"].item() == pytest.approx(0.5)
    # clipped tokens carry no gradient; the middle one gets -rho A / 3
    assert grads == pytest.approx([0.0, -1.0 / 3, 0.0])


def test_ppo_clip_seq_mean_token_mean_by_hand():
    loss, _, _ = _run(agg="seq_mean_token_mean", norm=2, clip_eps=0.2)
    assert loss == pytest.approx(((-1.2 - 1.0) / 2 + 0.8) / 2)


def test_aipo_caps_the_ratio_without_ppo_clip():
    # l = -min(rho, 1.4) A: -1.4 (capped), -1.0, -(0.5)(-1) = +0.5
    loss, stats, grads = _run(correction="aipo", is_cap=1.4)
    assert loss == pytest.approx((-1.4 - 1.0 + 0.5) / 3)
    assert stats["corrected"].item() == 1.0
    assert grads == pytest.approx([0.0, -1.0 / 3, 0.5 / 3])  # no lower clip: 0.5 still moves


def test_truncated_is_token_level():
    # l = -sg(min(rho, 1.4)) A log pi: gradient -w A = [-1.4, -1.0, +0.5] / 3
    loss, stats, grads = _run(correction="tis", is_cap=1.4, tis_level="token")
    expected = -(1.4 * math.log(1.5) + 0.0 + 0.5 * -1 * math.log(0.5)) / 3
    assert loss == pytest.approx(expected)
    assert stats["corrected"].item() == 1.0
    assert grads == pytest.approx([-1.4 / 3, -1.0 / 3, 0.5 / 3])


def test_truncated_is_sequence_level():
    # seq 0: prod rho = 1.5 -> w = 1.4 on both tokens; seq 1: prod rho = 0.5 -> w = 0.5
    _, stats, grads = _run(correction="tis", is_cap=1.4, tis_level="sequence")
    assert grads == pytest.approx([-1.4 / 3, -1.4 / 3, 0.5 / 3])
    assert stats["corrected"].item() == 2.0  # both tokens of the truncated sequence


def test_icepop_masks_tokens_outside_the_band():
    # band [0.6, 1.4]: tokens with rho 1.5 and 0.5 are masked; the rho = 1 token stays
    loss, stats, grads = _run(correction="icepop", icepop_low=0.6, icepop_high=1.4)
    assert loss == pytest.approx(-1.0 / 3)
    assert stats["corrected"].item() == 2.0
    assert grads == pytest.approx([0.0, -1.0 / 3, 0.0])


def test_mismatch_kl_is_zero_on_policy_and_k3_off_policy():
    _, stats, _ = _run()
    k3 = (0.5 - math.log(1.5)) + 0.0 + (-0.5 - math.log(0.5))
    assert stats["mismatch_kl"].item() == pytest.approx(k3)
    logp = torch.zeros(1, 2)
    _, s = policy_loss(logp, logp, torch.ones(1), torch.ones(1, 2), AlgorithmConfig(), 2)
    assert s["mismatch_kl"].item() == 0.0


def test_loss_gradient_is_minus_advantage_at_ratio_one():
    # On-policy (ratio 1) the gradient wrt logp of each token is -A / N_tokens, for all losses.
    for correction in ("none", "aipo", "tis", "icepop"):
        logp = torch.zeros(2, 2, requires_grad=True)
        loss, _ = policy_loss(logp, torch.zeros(2, 2), torch.tensor([2.0, -1.0]),
                              torch.ones(2, 2), AlgorithmConfig(correction=correction), 4)
        loss.backward()
        assert torch.allclose(logp.grad, torch.tensor([[-0.5, -0.5], [0.25, 0.25]])), correction


def test_micro_batches_sum_to_the_full_batch_loss():
    torch.manual_seed(0)
    logp, old = torch.randn(6, 5) * 0.1, torch.randn(6, 5) * 0.1
    adv, mask = torch.randn(6), (torch.rand(6, 5) > 0.3).float()
    n, cfg = mask.sum().item(), AlgorithmConfig()
    full, _ = policy_loss(logp, old, adv, mask, cfg, n)
    parts = sum(policy_loss(logp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], cfg, n)[0]
                for i in range(0, 6, 2))
    assert torch.allclose(full, parts, atol=1e-6)


# -- the other estimators, on one group r = [1, 0, 0, 0] (mean 0.25) -------------------------
R = torch.tensor([1.0, 0.0, 0.0, 0.0])
G = torch.tensor([0, 0, 0, 0])
L = torch.tensor([3, 3, 3, 3])


def test_dr_grpo_is_centred_without_std():
    a = compute_advantages("dr_grpo", R, G, L)
    assert torch.allclose(a, torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_rloo_subtracts_the_mean_of_the_others():
    # 1 - mean(0, 0, 0) = 1 ; 0 - mean(1, 0, 0) = -1/3
    a = compute_advantages("rloo", R, G, L)
    assert torch.allclose(a, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))


def test_reinforce_pp_whitens_over_the_batch():
    # mu = 0.25, sigma = sqrt(0.25 * 0.75): A = (r - mu) / sigma
    a = compute_advantages("reinforce_pp", R, G, L, eps=0.0)
    s = math.sqrt(0.25 * 0.75)
    assert torch.allclose(a, torch.tensor([0.75 / s] + [-0.25 / s] * 3), atol=1e-6)


def test_reinforce_pp_statistics_are_token_weighted():
    # lengths 1 and 3: mu = (1*1 + 0*3) / 4 = 0.25, E[r^2] = 0.25, sigma = sqrt(0.1875)
    a = compute_advantages("reinforce_pp", torch.tensor([1.0, 0.0]), torch.tensor([0, 1]),
                           torch.tensor([1, 3]), eps=0.0)
    s = math.sqrt(0.1875)
    assert torch.allclose(a, torch.tensor([0.75 / s, -0.25 / s]), atol=1e-6)


def test_reinforce_pp_baseline_by_hand():
    # groups [1, 0] and [1, 1] -> centred [0.5, -0.5, 0, 0]; mu 0, sigma sqrt(0.125)
    a = compute_advantages("reinforce_pp_baseline", torch.tensor([1.0, 0.0, 1.0, 1.0]),
                           torch.tensor([0, 0, 1, 1]), torch.ones(4), eps=0.0)
    s = math.sqrt(0.125)
    assert torch.allclose(a, torch.tensor([0.5 / s, -0.5 / s, 0.0, 0.0]), atol=1e-6)


def test_global_statistics_use_the_all_reduce():
    # two "ranks" holding one sample each must see the statistics of both
    other = torch.tensor([0.0 * 1, 0.0, 1.0])  # (sum w r, sum w r^2, sum w) of the other rank
    a = compute_advantages("reinforce_pp", torch.tensor([1.0]), torch.tensor([0]),
                           torch.tensor([1]), eps=0.0, all_reduce_sum=lambda t: t + other)
    assert torch.allclose(a, torch.tensor([1.0]))  # mu 0.5, sigma 0.5


def test_dr_grpo_constant_normaliser():
    # l = [-1.2, -1.0 | +0.8] (see _example); constant normaliser N_seqs * T_max = 2 * 4
    loss, _, _ = _run(agg="seq_sum_constant", norm=2 * 4, clip_eps=0.2)
    assert loss == pytest.approx((-1.2 - 1.0 + 0.8) / 8)


# -- KL to the reference policy, and the entropy bonus --------------------------------------
def test_kl_estimators_by_hand():
    from llamarl.algorithms.kl import kl_estimate

    logp, ref = torch.tensor([math.log(0.5), math.log(0.2)]), torch.tensor([math.log(0.25)] * 2)
    x = logp - ref  # [log 2, log 0.8]
    assert torch.allclose(kl_estimate(logp, ref, "k1"), x)
    assert torch.allclose(kl_estimate(logp, ref, "k2"), 0.5 * x * x)
    # k3 = ref/pi - 1 - log(ref/pi): 0.5 - 1 + log 2 ; 1.25 - 1 - log 1.25
    k3 = torch.tensor([0.5 - 1 + math.log(2), 1.25 - 1 - math.log(1.25)])
    assert torch.allclose(kl_estimate(logp, ref, "k3"), k3, atol=1e-6)
    assert (kl_estimate(logp, ref, "k3") >= 0).all()


def test_zero_kl_coef_loads_no_reference_model():
    from llamarl.config import load_config
    from llamarl.trainer.parts import load_reference

    assert load_reference(load_config(None, []), "/no/such/model", None, None) is None


def test_kl_term_is_zero_against_an_identical_reference_and_entropy_bonus_has_a_gradient():
    import copy

    from test_buffer import make_batch

    from llamarl.config import load_config
    from llamarl.tiny.model import build_model
    from llamarl.trainer.rl_step import policy_step
    from llamarl.trainer.step import PolicyTrainer

    batch = make_batch(2, 4, seed=7)
    base, tok = build_model(seed=0)
    ref = copy.deepcopy(base).eval()

    def run(*overrides, reference=None, entropy=False):
        model = copy.deepcopy(base)
        cfg = load_config(None, ["trainer.lr=1e-2", *overrides])
        t = PolicyTrainer(model, cfg.trainer, 1, 1, torch.device("cpu"), entropy_grad=entropy)
        stats = policy_step(t, batch, cfg, tok.pad_token_id, reference=reference)
        return stats, model

    plain, m_plain = run()
    with_kl, m_kl = run("algorithm.kl_coef=0.5", reference=ref)
    assert with_kl["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # same weights: k3 = 0
    assert with_kl["loss"] == pytest.approx(plain["loss"], abs=1e-6)
    _, m_ent = run("algorithm.entropy_coef=0.5", entropy=True)
    moved = max((a - b).abs().max().item()
                for a, b in zip(m_ent.parameters(), m_plain.parameters()))
    assert moved > 1e-6, "the entropy bonus must change the update"
