"""KL to a frozen reference policy, per token, from log pi_theta and log pi_ref of the sampled
token (x = log pi_theta - log pi_ref; samples come from the policy being trained):

    k1 = x                              unbiased, can be negative per token
    k2 = x^2 / 2                        biased, low variance, >= 0
    k3 = exp(-x) - 1 + x                unbiased and >= 0 (Schulman's estimator)

Used as a loss term:  L_kl = beta * agg_t(k(x_t))  with the policy loss's aggregation.
"""

from __future__ import annotations

import torch

ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate, same shape as the inputs."""
    x = logp - ref_logp
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x * x
    if estimator == "k3":
        return torch.exp(-x) - 1.0 + x
    raise ValueError(f"algorithm.kl_estimator {estimator!r}: use one of {', '.join(ESTIMATORS)}")
