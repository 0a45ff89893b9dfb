"""Policy losses for samples from a behaviour policy mu that differs from the trained pi_theta
(stale weights when max_staleness > 0, and the engine/trainer numeric mismatch always).

Per completion token t of sample i, with advantage A_i (or A_it: PPO's GAE, a KL reward
penalty) and the importance ratio

    rho_t = pi_theta(y_t | .) / mu(y_t | .) = exp(log pi_theta - log mu),

(sg = stop-gradient):

    none   (PPO clip)   l_t = -min(rho_t A, clip(rho_t, 1 - eps, 1 + eps) A)
    aipo   (LlamaRL)    l_t = -min(rho_t, delta) A
                        the ratio is capped at delta and there is no PPO clip: tokens whose
                        ratio exceeds delta contribute no gradient
    tis    (truncated IS, token)     l_t = -sg(min(rho_t, C)) A log pi_theta(y_t)
           (truncated IS, sequence)  l_t = -sg(min(prod_t rho_t, C)) A log pi_theta(y_t)
                        an unbiased-up-to-truncation policy gradient with bounded weights
    icepop              l_t = -M_t min(rho_t A, clip(rho_t, 1 - eps, 1 + eps) A),
                        M_t = 1[low <= rho_t <= high]: tokens where trainer and behaviour
                        disagree too much are masked out entirely

Aggregation over the whole global batch (all micro-batches, all trainer ranks), so the gradient
does not depend on how the batch is cut into micro-batches or ranks:

    token_mean:           L = sum_{i,t} l_it / N_tokens
    seq_mean_token_mean:  L = (1 / N_seqs) * sum_i (sum_t l_it / T_i)
    seq_sum_constant:     L = sum_{i,t} l_it / (N_seqs * T_max)
                          (Dr. GRPO; T_max = generator.max_new_tokens)

`normalizer` is N_tokens, N_seqs or N_seqs * T_max of the global batch. Stats returned (sums
over the micro-batch's completion tokens, or max / min):
`corrected` tokens clipped, capped, truncated or masked; `mismatch_kl`, the k3 estimate of
KL(mu || pi_theta) = E_mu[(rho - 1) - log rho]; `ratio_sum`, `ratio_max`, `ratio_min`.
"""

from __future__ import annotations

import torch

from llamarl.config import AlgorithmConfig


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: str,
              normalizer: float) -> torch.Tensor:
    """This micro-batch's share of the global aggregate of `per_token` [B, T] over `mask`."""
    per_token = per_token * mask
    if agg in ("token_mean", "seq_sum_constant"):
        return per_token.sum() / normalizer
    if agg == "seq_mean_token_mean":
        lens = mask.sum(dim=1).clamp(min=1)
        return (per_token.sum(dim=1) / lens).sum() / normalizer
    raise ValueError(f"algorithm.loss_agg {agg!r}: use token_mean, seq_mean_token_mean or "
                     "seq_sum_constant")


def policy_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, cfg: AlgorithmConfig,
                normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """logp, behaviour_logp, mask: [B, T]; advantages: [B] (per sequence) or [B, T] (per
    token). Returns (loss share, stats)."""
    mask = mask.float()
    log_ratio = (logp - behaviour_logp) * mask
    ratio = torch.exp(log_ratio)
    adv = (advantages[:, None] if advantages.dim() == 1 else advantages).to(logp.dtype)
    eps = cfg.clip_eps

    if cfg.correction in ("none", "icepop"):
        per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv)
        corrected = ((ratio - 1).abs() > eps) & (mask > 0)
        if cfg.correction == "icepop":
            keep = (ratio >= cfg.icepop_low) & (ratio <= cfg.icepop_high)
            per_token = per_token * keep
            corrected = ~keep & (mask > 0)
    elif cfg.correction == "aipo":
        per_token = -torch.clamp(ratio, max=cfg.is_cap) * adv
        corrected = (ratio > cfg.is_cap) & (mask > 0)
    elif cfg.correction == "tis":
        if cfg.tis_level == "token":
            weight = torch.clamp(ratio.detach(), max=cfg.is_cap)
            corrected = (ratio > cfg.is_cap) & (mask > 0)
        else:
            seq_ratio = torch.exp(log_ratio.detach().sum(dim=1, keepdim=True))
            weight = torch.clamp(seq_ratio, max=cfg.is_cap).expand_as(ratio)
            corrected = (seq_ratio > cfg.is_cap).expand_as(ratio) & (mask > 0)
        per_token = -weight * adv * logp
    else:
        raise ValueError(f"algorithm.correction {cfg.correction!r}: use none, aipo, tis or icepop")
    loss = aggregate(per_token, mask, cfg.loss_agg, normalizer)
    with torch.no_grad():
        valid = mask > 0
        big = torch.finfo(ratio.dtype).max
        stats = {
            "corrected": corrected.float().sum(),
            "mismatch_kl": ((ratio - 1.0) - log_ratio).mul(mask).sum(),
            "ratio_sum": (ratio * mask).sum(),
            "ratio_max": torch.where(valid, ratio, torch.zeros_like(ratio)).max(),
            "ratio_min": torch.where(valid, ratio, torch.full_like(ratio, big)).min(),
        }
    return loss, stats
