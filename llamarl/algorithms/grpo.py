"""GRPO's advantage estimator: group-normalised rewards.

For a prompt with G sampled completions and rewards r_1..r_G (one group):

    A_i = (r_i - mean(r)) / (std(r) + eps)          std: population std (divide by G)

and every completion token of sample i gets advantage A_i. The policy loss that consumes these
advantages (PPO clip, or an off-policy correction) is in policy_loss.py.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor,
                     eps: float = 1e-6) -> torch.Tensor:
    """rewards [B] float, group_ids [B] int -> advantages [B] (zero for all-equal groups)."""
    adv = torch.empty_like(rewards, dtype=torch.float32)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        r = rewards[idx].float()
        adv[idx] = (r - r.mean()) / (r.std(unbiased=False) + eps)
    return adv
