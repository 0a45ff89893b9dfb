"""PPO's token-level advantages: per-token rewards, GAE, whitening, and the clipped value loss.

All tensors are [B, T] over token positions, with `mask` = 1 on the completion tokens (a
contiguous run per row; see trainer.policy.TokenBatch: position t scores token t+1).

Per-token rewards of a completion with outcome reward R and T_i tokens (t = 1..T_i):

    r_t = -beta * KL_t + (R if t == T_i else 0)          (KL_t: a per-token KL estimate to the
                                                          reference; beta = 0 without one)

Generalised advantage estimation with the critic's values V_t (V after the last token = 0):

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = sum_{l >= 0} (gamma * lambda)^l * delta_{t+l}      (within the completion)
    R_t     = A_t + V_t                                           (the value target)

The clipped value loss (PPO2's), with V_old the values used for GAE:

    V_clip = V_old + clip(V - V_old, -c, c)
    L_V    = 1/2 * max((V - R_t)^2, (V_clip - R_t)^2)             per token, then aggregated
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def last_token_mask(mask: torch.Tensor) -> torch.Tensor:
    """1 at the last completion position of each row, [B, T] (all 0 for an empty row)."""
    count = mask.sum(dim=1, keepdim=True)
    return ((mask.cumsum(dim=1) == count) & (mask > 0)).to(mask.dtype)


def token_rewards(rewards: torch.Tensor, mask: torch.Tensor,
                  kl: torch.Tensor | None = None, kl_coef: float = 0.0) -> torch.Tensor:
    """rewards [B] (outcome), mask [B, T], kl [B, T] or None -> per-token rewards [B, T]."""
    out = last_token_mask(mask) * rewards.to(mask.dtype)[:, None]
    if kl is not None and kl_coef:
        out = out - kl_coef * kl * mask
    return out


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards, values, mask [B, T] -> (advantages, returns) [B, T], 0 off the mask."""
    values = values * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    T = values.shape[1]
    for t in reversed(range(T)):
        nxt = mask[:, t + 1] if t + 1 < T else torch.zeros_like(running)
        next_value = values[:, t + 1] * nxt if t + 1 < T else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * nxt * running  # resets at the completion's end
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def reward_to_go(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_{s >= t} x_s within the completion, [B, T] (gamma = 1). Used to add a per-token KL
    penalty to the sequence-level advantages of the outcome estimators (GRPO, RLOO, ...)."""
    x = per_token * mask
    return (x.flip(1).cumsum(1).flip(1)) * mask


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8,
                  all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                  ) -> torch.Tensor:
    """(x - mu) / (sigma + eps) with mu, sigma over the masked tokens of the global batch
    (sums reduced over the trainer ranks by `all_reduce_sum`)."""
    m = mask.to(values.dtype)
    sums = all_reduce_sum(torch.stack([(values * m).sum(), (values * values * m).sum(),
                                       m.sum()]))
    mu = sums[0] / sums[2].clamp(min=1)
    var = (sums[1] / sums[2].clamp(min=1) - mu * mu).clamp(min=0)
    return (values - mu) / (var.sqrt() + eps) * m


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss [B, T] and where the clipped branch was taken [B, T]."""
    unclipped = (values - returns) ** 2
    if clip <= 0:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    v_clip = old_values + torch.clamp(values - old_values, -clip, clip)
    clipped = (v_clip - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped
