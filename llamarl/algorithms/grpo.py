"""GRPO: group-normalised advantages and the clipped surrogate policy loss.

For a prompt with G sampled completions and rewards r_1..r_G (one group):

    A_i = (r_i - mean(r)) / (std(r) + eps)          std: population std (divide by G)

and every completion token of sample i gets advantage A_i. With the importance ratio of each
completion token against the behaviour policy that sampled it,

    rho_t = exp(log pi_theta(y_t | y_<t) - log pi_behaviour(y_t | y_<t)),

the per-token loss is the PPO clipped surrogate

    l_t = -min(rho_t * A_i, clip(rho_t, 1 - eps_clip, 1 + eps_clip) * A_i),

aggregated over the whole global batch (all micro-batches, all trainer ranks):

    token_mean:           L = sum_{i,t} l_it / N_tokens
    seq_mean_token_mean:  L = (1 / N_seqs) * sum_i (sum_t l_it / T_i)

so the gradient does not depend on how the batch is cut into micro-batches or ranks.
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


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, clip_eps: float, agg: str,
                        normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of the micro-batch's share of the global loss.

    logp, old_logp, mask: [B, T] (mask 1 on completion tokens); advantages: [B].
    normalizer: N_tokens (token_mean) or N_seqs (seq_mean_token_mean) of the global batch, so
    summing the returned loss over micro-batches and ranks gives L above.
    Returns (loss, stats) where stats are sums over this micro-batch's tokens.
    """
    mask = mask.float()
    log_ratio = (logp - old_logp) * mask
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped) * mask
    if agg == "token_mean":
        loss = per_token.sum() / normalizer
    elif agg == "seq_mean_token_mean":
        lens = mask.sum(dim=1).clamp(min=1)
        loss = (per_token.sum(dim=1) / lens).sum() / normalizer
    else:
        raise ValueError(f"algorithm.loss_agg {agg!r}: use token_mean or seq_mean_token_mean")
    with torch.no_grad():
        was_clipped = ((ratio - 1.0).abs() > clip_eps).float() * mask
        stats = {
            "clip_frac": was_clipped.sum(),
            # k3 estimator of KL(behaviour || current): (rho - 1) - log rho, per token
            "mismatch_kl": ((ratio - 1.0) - log_ratio).mul(mask).sum(),
            "ratio_max": (ratio * mask).max(),
        }
    return loss, stats
