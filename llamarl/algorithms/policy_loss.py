"""Policy losses for samples from a behaviour policy mu that differs from the trained pi_theta
(stale weights when max_staleness > 0, and the engine/trainer numeric mismatch always).

Per sampled token t of sample i, with advantage A (A_i, or A_it: PPO's GAE, a KL reward
penalty), the importance ratio rho_t = pi_theta(y_t | .) / mu(y_t | .) = exp(log pi - log mu)
and the clip range [1 - eps_low, 1 + eps_high] (algorithm.clip_eps_low / clip_eps_high, both
algorithm.clip_eps unless set: DAPO's clip-higher raises eps_high), sg = stop-gradient:

    ppo_clip  l_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)
    aipo      l_t = -min(rho_t, delta) A             (LlamaRL; no clip: tokens whose ratio
                                                      exceeds delta = is_cap give no gradient)
    tis       l_t = -sg(min(w, C)) A log pi_theta(y_t)            truncated IS, C = is_cap;
              w = rho_t (tis_level token) or prod_t rho_t (sequence)
    icepop    l_t = M_t * ppo_clip_t,  M_t = 1[icepop_low <= rho_t <= icepop_high]
    mis       l_t = M * ppo_clip_t: masked (rejection) IS, the mask by mis_level:
                token      M_t = 1[mis_low <= rho_t <= mis_high]
                sequence   M_i = 1[mis_low <= prod_t rho_t <= mis_high]
                geometric  M_i = 1[mis_low <= exp(mean_t log rho_t) <= mis_high]
    gspo      s_i = exp((1 / |y_i|) sum_t log rho_t)           (GSPO, sequence level)
              l_t = -min(s_i A, clip(s_i, 1 - eps_low, 1 + eps_high) A)  on every token of i;
              with loss_agg = seq_mean_token_mean this is GSPO's per-sequence objective
    cispo     l_t = -sg(clip(rho_t, 1 - eps_low, 1 + eps_high)) A log pi_theta(y_t)
              (MiniMax-M1's CISPO: every token keeps its gradient, its IS weight is clipped)

Aggregation over the whole global batch (all micro-batches, all trainer ranks), so the gradient
does not depend on how the batch is cut into micro-batches or ranks:

    token_mean:           L = sum_{i,t} l_it / N_tokens
    seq_mean_token_mean:  L = (1 / N_seqs) * sum_i (sum_t l_it / T_i)
    seq_sum_constant:     L = sum_{i,t} l_it / (N_seqs * T_max)
                          (Dr. GRPO; T_max = generator.max_new_tokens)

`normalizer` is N_tokens, N_seqs or N_seqs * T_max of the global batch. Stats returned (sums
over the micro-batch's sampled tokens, or max / min): `corrected` tokens clipped, capped,
truncated or masked; `mismatch_kl`, the k3 estimate of KL(mu || pi_theta) = E_mu[(rho - 1) -
log rho]; `ratio_sum`, `ratio_max`, `ratio_min`.

A loss of your own: `algorithm.policy_loss: module:function` with the signature of the
functions below (llamarl/registry/algorithms.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llamarl.config import AlgorithmConfig
from llamarl.registry.algorithms import POLICY_LOSSES, policy_loss_name, resolve


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


@dataclass
class LossInputs:
    """What a policy loss reads, [B, T] each: logp = log pi_theta of the sampled tokens (with
    gradient), behaviour_logp = log mu, advantages (per-sample ones broadcast), mask (float,
    1 on the tokens the policy sampled)."""

    logp: torch.Tensor
    behaviour_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor

    @property
    def log_ratio(self) -> torch.Tensor:
        return (self.logp - self.behaviour_logp) * self.mask

    @property
    def ratio(self) -> torch.Tensor:
        return torch.exp(self.log_ratio)


def _eps(cfg: AlgorithmConfig) -> tuple[float, float]:
    low = cfg.clip_eps if cfg.clip_eps_low is None else cfg.clip_eps_low
    high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    return low, high


def ppo_clip(x: LossInputs, cfg: AlgorithmConfig):
    low, high = _eps(cfg)
    ratio, adv = x.ratio, x.advantages
    per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - low, 1 + high) * adv)
    corrected = ((ratio < 1 - low) | (ratio > 1 + high)) & (x.mask > 0)
    return per_token, corrected


def aipo(x: LossInputs, cfg: AlgorithmConfig):
    ratio = x.ratio
    return -torch.clamp(ratio, max=cfg.is_cap) * x.advantages, (ratio > cfg.is_cap) & (x.mask > 0)


def tis(x: LossInputs, cfg: AlgorithmConfig):
    ratio = x.ratio
    if cfg.tis_level == "token":
        weight = torch.clamp(ratio.detach(), max=cfg.is_cap)
        corrected = (ratio > cfg.is_cap) & (x.mask > 0)
    else:
        seq_ratio = torch.exp(x.log_ratio.detach().sum(dim=1, keepdim=True))
        weight = torch.clamp(seq_ratio, max=cfg.is_cap).expand_as(ratio)
        corrected = (seq_ratio > cfg.is_cap).expand_as(ratio) & (x.mask > 0)
    return -weight * x.advantages * x.logp, corrected


def icepop(x: LossInputs, cfg: AlgorithmConfig):
    per_token, _ = ppo_clip(x, cfg)
    keep = (x.ratio >= cfg.icepop_low) & (x.ratio <= cfg.icepop_high)
    return per_token * keep, ~keep & (x.mask > 0)


def mis(x: LossInputs, cfg: AlgorithmConfig):
    per_token, _ = ppo_clip(x, cfg)
    with torch.no_grad():
        if cfg.mis_level == "token":
            stat = x.ratio
        else:
            log_seq = x.log_ratio.sum(dim=1, keepdim=True)
            if cfg.mis_level == "geometric":
                log_seq = log_seq / x.mask.sum(dim=1, keepdim=True).clamp(min=1)
            stat = torch.exp(log_seq).expand_as(x.ratio)
        keep = (stat >= cfg.mis_low) & (stat <= cfg.mis_high)
    return per_token * keep, ~keep & (x.mask > 0)


def gspo(x: LossInputs, cfg: AlgorithmConfig):
    low, high = _eps(cfg)
    lens = x.mask.sum(dim=1, keepdim=True).clamp(min=1)
    s = torch.exp(x.log_ratio.sum(dim=1, keepdim=True) / lens).expand_as(x.logp)
    adv = x.advantages
    per_token = -torch.minimum(s * adv, torch.clamp(s, 1 - low, 1 + high) * adv)
    return per_token, ((s < 1 - low) | (s > 1 + high)) & (x.mask > 0)


def cispo(x: LossInputs, cfg: AlgorithmConfig):
    low, high = _eps(cfg)
    ratio = x.ratio
    weight = torch.clamp(ratio.detach(), 1 - low, 1 + high)
    corrected = ((ratio < 1 - low) | (ratio > 1 + high)) & (x.mask > 0)
    return -weight * x.advantages * x.logp, corrected


def policy_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, cfg: AlgorithmConfig,
                normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """logp, behaviour_logp, mask: [B, T]; advantages: [B] (per sequence) or [B, T] (per
    token). The loss algorithm.policy_loss (or correction, or the algorithm's) selects.
    Returns (this micro-batch's share of the aggregated loss, stats)."""
    mask = mask.float()
    adv = (advantages[:, None] if advantages.dim() == 1 else advantages).to(logp.dtype)
    x = LossInputs(logp, behaviour_logp, adv.expand_as(logp), mask)
    name = policy_loss_name(cfg)
    per_token, corrected = resolve(name, POLICY_LOSSES, "algorithm.policy_loss")(x, cfg)
    loss = aggregate(per_token, mask, cfg.loss_agg, normalizer)
    with torch.no_grad():
        ratio, log_ratio = x.ratio, x.log_ratio
        valid = mask > 0
        big = torch.finfo(ratio.dtype).max
        stats = {
            "corrected": (corrected & valid).float().sum(),
            "mismatch_kl": ((ratio - 1.0) - log_ratio).mul(mask).sum(),
            "ratio_sum": (ratio * mask).sum(),
            "ratio_max": torch.where(valid, ratio, torch.zeros_like(ratio)).max(),
            "ratio_min": torch.where(valid, ratio, torch.full_like(ratio, big)).min(),
        }
    return loss, stats
