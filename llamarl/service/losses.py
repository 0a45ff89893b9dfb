"""The losses of the Tinker API's `forward_backward`, as Tinker defines them (docs/service.md).

Every loss is a function of one datum's tensors, all of length N (the datum's positions:
position i of `model_input` predicts `target_tokens[i]`):

    target_logprobs [N]  log p_theta(target_tokens[i] | model_input[:i+1]): the model's, with
                         the gradient
    inputs               the datum's `loss_fn_inputs`, float tensors [N] (target_tokens
                         aside): `weights`, `logprobs` (the sampler's, q), `advantages`, ...
    config               `loss_fn_config` (clip thresholds, beta)

and returns the datum's loss, a scalar: a **sum over its tokens, not a mean**, and the
request's loss is the sum over its data (what the SDK reports as `loss:sum`). llamarl's own
RL losses are batch means (algorithms/policy_loss.py); these are not, so that a user's loop
gets Tinker's numbers and Tinker's gradient scale.

    cross_entropy        -sum_i w_i lp_i
    importance_sampling  -sum_i exp(lp_i - q_i) A_i
    ppo                  -sum_i min(r_i A_i, clip(r_i, lo, hi) A_i),      r_i = exp(lp_i - q_i)
    cispo                -sum_i sg(clip(r_i, lo, hi)) lp_i A_i
    dro                  -sum_i (lp_i A_i - beta/2 (lp_i - q_i)^2)
    gspo                 -sum_i min(s_i A_i, clip(s_i, lo, hi) A_i),
                         s_i = exp(mean_{j in M}(sg(lp_j) - q_j) + lp_i - sg(lp_i))
                         (GSPO-token: every token carries the sequence ratio's value over the
                         tokens M that `sequence_ratio_mask` marks, all of them without one,
                         and its own log-probability's gradient)

lo, hi: `clip_low_threshold`, `clip_high_threshold` (0.8, 1.2: Tinker's epsilon of 0.2);
beta: `beta` (DRO_BETA).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CLIP_LOW, CLIP_HIGH = 0.8, 1.2
DRO_BETA = 0.05  # Tinker's documentation shows it as a loss_fn_config example; its default is
# not published: pass `beta` to be sure


def cross_entropy(lp: torch.Tensor, inputs: dict, config: dict) -> torch.Tensor:
    return -(inputs["weights"] * lp).sum()


def importance_sampling(lp: torch.Tensor, inputs: dict, config: dict) -> torch.Tensor:
    return -(torch.exp(lp - inputs["logprobs"]) * inputs["advantages"]).sum()


def ppo(lp: torch.Tensor, inputs: dict, config: dict) -> torch.Tensor:
    return _clipped_objective(torch.exp(lp - inputs["logprobs"]), inputs["advantages"], config)


def cispo(lp: torch.Tensor, inputs: dict, config: dict) -> torch.Tensor:
    ratio = torch.exp(lp - inputs["logprobs"]).clamp(*_thresholds(config))
    return -(ratio.detach() * lp * inputs["advantages"]).sum()


def dro(lp: torch.Tensor, inputs: dict, config: dict) -> torch.Tensor:
    beta = float(config.get("beta", DRO_BETA))
    penalty = (lp - inputs["logprobs"]) ** 2
    return -(lp * inputs["advantages"] - 0.5 * beta * penalty).sum()


def gspo(lp: torch.Tensor, inputs: dict, config: dict) -> torch.Tensor:
    marked = inputs.get("sequence_ratio_mask")
    marked = torch.ones_like(lp, dtype=torch.bool) if marked is None else marked != 0
    log_ratio = ((lp.detach() - inputs["logprobs"])[marked].mean() if bool(marked.any())
                 else lp.new_zeros(()))
    ratio = torch.exp(log_ratio + lp - lp.detach())
    return _clipped_objective(ratio, inputs["advantages"], config)


def _thresholds(config: dict) -> tuple[float, float]:
    return (float(config.get("clip_low_threshold", CLIP_LOW)),
            float(config.get("clip_high_threshold", CLIP_HIGH)))


def _clipped_objective(ratio: torch.Tensor, advantages: torch.Tensor,
                       config: dict) -> torch.Tensor:
    clipped = ratio.clamp(*_thresholds(config))
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()


LossFn = Callable[[torch.Tensor, dict, dict], torch.Tensor]

# name -> (the function, the loss_fn_inputs it needs besides target_tokens, the optional ones,
# the loss_fn_config keys it reads)
LOSSES: dict[str, tuple[LossFn, tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "cross_entropy": (cross_entropy, ("weights",), (), ()),
    "importance_sampling": (importance_sampling, ("logprobs", "advantages"), ("weights",), ()),
    "ppo": (ppo, ("logprobs", "advantages"), ("weights",),
            ("clip_low_threshold", "clip_high_threshold")),
    "cispo": (cispo, ("logprobs", "advantages"), ("weights",),
              ("clip_low_threshold", "clip_high_threshold")),
    "dro": (dro, ("logprobs", "advantages"), ("weights",), ("beta",)),
    "gspo": (gspo, ("logprobs", "advantages"), ("weights", "sequence_ratio_mask"),
             ("clip_low_threshold", "clip_high_threshold")),
}


def check_loss(name: str, config: dict | None) -> None:
    """A ValueError naming the problem and the fix for an unknown loss or config key."""
    if name not in LOSSES:
        raise ValueError(f"loss_fn {name!r} is not one this server computes: use one of "
                         f"{sorted(LOSSES)} (or forward_backward_custom)")
    keys = LOSSES[name][3]
    for key, value in (config or {}).items():
        if key not in keys:
            raise ValueError(f"loss_fn_config key {key!r} is not read by {name}: "
                             f"{list(keys) or 'it takes none'}")
        if not isinstance(value, (int, float)):
            raise ValueError(f"loss_fn_config[{key!r}] = {value!r}: give a number")


def check_inputs(name: str, n: int, inputs: dict, index: int) -> None:
    """Datum `index`'s loss_fn_inputs for loss `name`: every needed key present, every tensor
    of the datum's length `n`, no key the loss does not read."""
    _, needed, optional, _ = LOSSES[name]
    allowed = {"target_tokens", *needed, *optional}
    for key in ("target_tokens", *needed):
        if key not in inputs:
            raise ValueError(f"data[{index}].loss_fn_inputs has no {key!r}, which {name} "
                             f"needs: give {sorted({'target_tokens', *needed})}")
    for key, t in inputs.items():
        if key not in allowed:
            raise ValueError(f"data[{index}].loss_fn_inputs[{key!r}] is not read by {name}: "
                             f"it reads {sorted(allowed)}")
        if tuple(t.shape) != (n,):
            raise ValueError(f"data[{index}].loss_fn_inputs[{key!r}] has shape "
                             f"{list(t.shape)}, the datum has {n} positions: give [{n}]")
