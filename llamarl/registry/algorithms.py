"""The algorithm registry: one place that names every advantage estimator, policy loss and
algorithm, and says what each algorithm needs. Torch-free (names and import paths only), so the
recipe validation reads it before anything heavy is imported.

    algorithm.name         an ALGORITHMS key: its advantage estimator, its policy loss, and
                           whether it needs a critic (per-token advantages from GAE) or a
                           teacher (per-token advantages from the teacher's logprobs)
    algorithm.advantage    "" (the algorithm's) | an ESTIMATORS key | "module:function"
    algorithm.policy_loss  "" (the algorithm's, or algorithm.correction's when that is set)
                           | a POLICY_LOSSES key | "module:function"

Signatures (docs/algorithms.md has the maths and a worked example):

    estimator(rewards [B], group_ids [B], lengths [B], eps, all_reduce_sum) -> advantages [B]
        lengths = tokens the policy sampled per sample; all_reduce_sum sums a tensor over
        the trainer ranks (for global-batch statistics)
    policy_loss(x: LossInputs, cfg: AlgorithmConfig) -> (per_token [B, T], corrected [B, T])
        x.logp (with gradient), x.behaviour_logp, x.advantages, x.mask: [B, T] tensors;
        per_token is aggregated over the mask by algorithm.loss_agg; corrected marks tokens
        clipped, capped or masked (reported as clip_frac)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from llamarl.imports import import_path


@dataclass(frozen=True)
class Algorithm:
    advantage: str  # an ESTIMATORS key, or "gae" (per-token advantages from a critic)
    policy_loss: str  # a POLICY_LOSSES key
    summary: str
    # per-token advantages from a frozen teacher (algorithms/distill.py); `advantage` is then
    # the estimator of the task reward mixed in with algorithm.reward_coef
    teacher: bool = False

    @property
    def critic(self) -> bool:
        return self.advantage == "gae"


_ADV = "llamarl.algorithms.advantages"
_LOSS = "llamarl.algorithms.policy_loss"

ESTIMATORS = {name: f"{_ADV}:{name}" for name in
              ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")}
POLICY_LOSSES = {name: f"{_LOSS}:{name}" for name in
                 ("ppo_clip", "aipo", "tis", "icepop", "mis", "gspo", "cispo")}
ALGORITHMS = {
    "grpo": Algorithm("grpo", "ppo_clip", "group-normalised advantages, PPO clip"),
    "dr_grpo": Algorithm("dr_grpo", "ppo_clip", "GRPO without the std normalisation"),
    "rloo": Algorithm("rloo", "ppo_clip", "leave-one-out baseline"),
    "reinforce_pp": Algorithm("reinforce_pp", "ppo_clip", "global-batch whitened rewards"),
    "reinforce_pp_baseline": Algorithm("reinforce_pp_baseline", "ppo_clip",
                                       "group baseline, then global whitening"),
    "ppo": Algorithm("gae", "ppo_clip", "critic, GAE, PPO clip"),
    "gspo": Algorithm("grpo", "gspo", "sequence-level, length-normalised ratio, clipped"),
    "cispo": Algorithm("grpo", "cispo", "clipped stop-gradient IS weights, REINFORCE"),
    "on_policy_distill": Algorithm("grpo", "ppo_clip", "per-token reverse KL to a teacher as "
                                   "the advantage (+ reward_coef x GRPO's)", teacher=True),
}
# algorithm.correction (off-policy corrections against the behaviour policy) -> its loss
CORRECTIONS = {"none": "", "aipo": "aipo", "tis": "tis", "icepop": "icepop", "mis": "mis"}


def is_import_path(spec: str) -> bool:
    return ":" in spec and not spec.startswith(":") and not spec.endswith(":")


def policy_loss_name(cfg) -> str:
    """The policy loss an AlgorithmConfig selects (a POLICY_LOSSES key or module:function)."""
    return cfg.policy_loss or CORRECTIONS[cfg.correction] or ALGORITHMS[cfg.name].policy_loss


def algorithm(cfg) -> Algorithm:
    """What the algorithm of an AlgorithmConfig is and needs (.critic, .teacher): the one
    lookup the roles make, rather than comparing algorithm names."""
    return ALGORITHMS[cfg.name]


def advantage_name(cfg) -> str:
    return cfg.advantage or ALGORITHMS[cfg.name].advantage


def resolve(spec: str, table: dict[str, str], key: str) -> Callable:
    """The function a registry name or a "module:function" import path names (imported once:
    the policy loss is looked up on every micro-batch)."""
    path = table.get(spec, spec)
    if not is_import_path(path):
        raise ValueError(f"{key} {spec!r}: use one of {', '.join(table)} or 'module:function'")
    return _import_function(path, f"{key} {spec!r}")


@functools.cache
def _import_function(path: str, what: str) -> Callable:
    fn = import_path(path, what)
    if not callable(fn):
        raise ValueError(f"{what} is not a function")
    return fn
