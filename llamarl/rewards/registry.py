"""Reward functions by name: built-in verifiers, or a user's `module:function`.

A reward function is `fn(completion: str, answer: str, prompt: str) -> float`. The recipe's
`reward.functions` names them and `reward.weights` weighs them (llamarl/rewards/scorer.py adds
them up). Built-ins run in the generator process; user functions run in a separate worker
process (llamarl/rewards/sandbox.py), where one that hangs can be stopped.
"""

from __future__ import annotations

from collections.abc import Callable

from llamarl.config import BUILTIN_REWARDS
from llamarl.imports import import_path
from llamarl.rewards import verifiers
from llamarl.tiny.task import reverse_reward

RewardFn = Callable[[str, str, str], float]

REGISTRY: dict[str, RewardFn] = {}


def register(name: str):
    def deco(fn: RewardFn) -> RewardFn:
        REGISTRY[name] = fn
        return fn
    return deco


@register("reverse_match")
def _reverse_match(completion: str, answer: str, prompt: str) -> float:
    return reverse_reward(completion, answer)


@register("exact_match")
def exact_match(completion: str, answer: str, prompt: str) -> float:
    return float(completion.strip() == answer.strip())


register("gsm8k")(verifiers.gsm8k)
register("numeric")(verifiers.numeric)
register("boxed")(verifiers.boxed)


def is_user_function(name: str) -> bool:
    return name not in BUILTIN_REWARDS and ":" in name


def resolve_builtin(name: str, format_pattern: str) -> RewardFn:
    """A built-in verifier; `format` checks completions against `format_pattern`."""
    if name == "format":
        return verifiers.FormatReward(format_pattern)
    if name in REGISTRY:
        return REGISTRY[name]
    raise ValueError(f"reward function {name!r} is unknown: use one of "
                     f"{', '.join(BUILTIN_REWARDS)} or 'module:function'")


def resolve_user(name: str) -> RewardFn:
    """Import `module:function` (done inside the reward worker process)."""
    fn = import_path(name, f"reward function {name!r}")
    if not callable(fn):
        raise ValueError(f"reward function {name!r} is not callable")
    return fn
