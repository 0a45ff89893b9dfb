"""GRPO math against values worked out by hand."""

import math

import torch

from llamarl.algorithms.grpo import clipped_policy_loss, group_advantages


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


def _example():
    # seq 0 (A = +1): token ratios 1.5 and 1.0; seq 1 (A = -1): one token with ratio 0.5
    old = torch.zeros(2, 3)
    logp = torch.tensor([[math.log(1.5), 0.0, 0.0], [math.log(0.5), 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    return logp, old, adv, mask


def test_clipped_surrogate_token_mean_by_hand():
    # per-token: -min(1.5, 1.2) = -1.2 ; -min(1.0, 1.0) = -1.0 ; -min(-0.5, -0.8) = +0.8
    logp, old, adv, mask = _example()
    loss, stats = clipped_policy_loss(logp, old, adv, mask, 0.2, "token_mean", normalizer=3)
    assert math.isclose(loss.item(), (-1.2 - 1.0 + 0.8) / 3, rel_tol=1e-6)
    assert stats["clip_frac"].item() == 2.0
    assert math.isclose(stats["ratio_max"].item(), 1.5, rel_tol=1e-6)


def test_clipped_surrogate_seq_mean_token_mean_by_hand():
    logp, old, adv, mask = _example()
    loss, _ = clipped_policy_loss(logp, old, adv, mask, 0.2, "seq_mean_token_mean", normalizer=2)
    assert math.isclose(loss.item(), ((-1.2 - 1.0) / 2 + 0.8) / 2, rel_tol=1e-6)


def test_loss_gradient_is_minus_advantage_at_ratio_one():
    # On-policy (ratio 1) the gradient wrt logp of each token is -A / N_tokens.
    logp = torch.zeros(2, 2, requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    mask = torch.ones(2, 2)
    loss, _ = clipped_policy_loss(logp, torch.zeros(2, 2), adv, mask, 0.2, "token_mean", 4)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, -0.5], [0.25, 0.25]]))


def test_micro_batches_sum_to_the_full_batch_loss():
    torch.manual_seed(0)
    logp, old = torch.randn(6, 5) * 0.1, torch.randn(6, 5) * 0.1
    adv, mask = torch.randn(6), (torch.rand(6, 5) > 0.3).float()
    n = mask.sum().item()
    full, _ = clipped_policy_loss(logp, old, adv, mask, 0.2, "token_mean", n)
    parts = sum(clipped_policy_loss(logp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2],
                                    0.2, "token_mean", n)[0] for i in range(0, 6, 2))
    assert torch.allclose(full, parts, atol=1e-6)
