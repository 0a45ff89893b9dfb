"""Advantage estimators for outcome rewards (one scalar reward per completion).

For a prompt with G completions and rewards r_1..r_G (one group), every completion token of
sample i gets the advantage A_i:

    grpo                   A_i = (r_i - mean(r)) / (std(r) + eps)         std: population std
    dr_grpo                A_i =  r_i - mean(r)          (Dr. GRPO: no std normalisation; pair
                                                          it with loss_agg = seq_sum_constant)
    rloo                   A_i =  r_i - mean_{j != i} r_j  =  G / (G - 1) * (r_i - mean(r))
    reinforce_pp           A_i = (r_i - mu) / (sigma + eps)     mu, sigma over every completion
                                                                token of the global batch
    reinforce_pp_baseline  b_i = r_i - mean(r) (group baseline), then
                           A_i = (b_i - mu_b) / (sigma_b + eps) over the global batch's tokens

The global-batch statistics of REINFORCE++ are token-weighted (a completion of T_i tokens
counts T_i times) and summed over all trainer ranks through `all_reduce_sum`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llamarl.registry.algorithms import ESTIMATORS, resolve

# A group whose rewards spread by no more than this counts as all equal (float noise; the same
# rule as dynamic sampling's, rewards/dynamic_sampling.py).
EQUAL_REWARDS_TOL = 1e-6


def _group_centered(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """r - mean(group), the group's population std and its size, per sample.

    A group whose rewards are all equal gets exactly 0 and std 0: its float32 mean is not
    always its value (eight rewards of 0.9 average to 0.9 - 6e-8), and GRPO divides that
    rounding error by std + eps ~ 1e-6, which gave every sample of the group an advantage of
    +-0.056, one sign for the whole group."""
    centered = torch.empty_like(rewards, dtype=torch.float32)
    std = torch.empty_like(centered)
    size = torch.empty_like(centered)
    equal = equal_reward_groups(rewards, group_ids)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        r = rewards[idx].float()
        if equal[idx][0]:
            centered[idx], std[idx] = 0.0, 0.0
        else:
            centered[idx] = r - r.mean()
            std[idx] = r.std(unbiased=False)
        size[idx] = float(len(r))
    return centered, std, size


def equal_reward_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """rewards, group_ids: [B] -> bool [B]: whether the sample's group has all its rewards
    equal (spread <= EQUAL_REWARDS_TOL): no signal under a group baseline."""
    if not len(rewards):
        return torch.zeros(0, dtype=torch.bool)
    _, inv = torch.unique(group_ids, return_inverse=True)
    r = rewards.float()
    top = torch.full((int(inv.max()) + 1,), -torch.inf).scatter_reduce(0, inv, r, "amax")
    low = torch.full_like(top, torch.inf).scatter_reduce(0, inv, r, "amin")
    return (top - low)[inv] <= EQUAL_REWARDS_TOL


def _whiten(values: torch.Tensor, weights: torch.Tensor, eps: float,
            all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """(v - mu) / (sigma + eps), mu and sigma weighted by `weights` over the global batch."""
    w = weights.float()
    sums = all_reduce_sum(torch.stack([(w * values).sum(), (w * values * values).sum(),
                                       w.sum()]))
    mu = sums[0] / sums[2].clamp(min=1)
    var = (sums[1] / sums[2].clamp(min=1) - mu * mu).clamp(min=0)
    return (values - mu) / (var.sqrt() + eps)


def grpo(rewards, group_ids, lengths, eps=1e-6, all_reduce_sum=lambda t: t):
    centered, std, _ = _group_centered(rewards, group_ids)
    return centered / (std + eps)


def dr_grpo(rewards, group_ids, lengths, eps=1e-6, all_reduce_sum=lambda t: t):
    return _group_centered(rewards, group_ids)[0]


def rloo(rewards, group_ids, lengths, eps=1e-6, all_reduce_sum=lambda t: t):
    centered, _, size = _group_centered(rewards, group_ids)
    return centered * size / (size - 1).clamp(min=1)


def reinforce_pp(rewards, group_ids, lengths, eps=1e-6, all_reduce_sum=lambda t: t):
    return _whiten(rewards.float(), lengths, eps, all_reduce_sum)


def reinforce_pp_baseline(rewards, group_ids, lengths, eps=1e-6, all_reduce_sum=lambda t: t):
    return _whiten(_group_centered(rewards, group_ids)[0], lengths, eps, all_reduce_sum)


def compute_advantages(name: str, rewards: torch.Tensor, group_ids: torch.Tensor,
                       lengths: torch.Tensor, eps: float = 1e-6,
                       all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                       ) -> torch.Tensor:
    """rewards, group_ids, lengths (sampled tokens): [B] -> advantages [B], by the estimator
    `name` (a registry key or "module:function", llamarl/registry/algorithms.py)."""
    fn = resolve(name, ESTIMATORS, "algorithm.advantage")
    out = fn(rewards, group_ids, lengths, eps, all_reduce_sum)
    if not (isinstance(out, torch.Tensor) and out.shape == rewards.shape):
        raise ValueError(f"algorithm.advantage {name!r} returned "
                         f"{getattr(out, 'shape', type(out).__name__)}, not a tensor of shape "
                         f"{tuple(rewards.shape)} (one advantage per sample)")
    return out.float()


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO's group-normalised advantages (kept as the short name for the default)."""
    return compute_advantages("grpo", rewards, group_ids, torch.ones_like(rewards), eps)
