"""Reward functions by name: built-in verifiers, or a user's `module:function`.

A reward function is `fn(completion: str, answer: str, prompt: str) -> float`. Several can be
combined with weights: reward = sum_k w_k * fn_k(...). A function that raises stops the run with
an error naming the function and the sample (never a silent zero).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

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


def resolve(name: str) -> RewardFn:
    if name in REGISTRY:
        return REGISTRY[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward function {name!r} cannot be imported ({e}): check the "
                             "module is on PYTHONPATH and defines the function") from None
        if not callable(fn):
            raise ValueError(f"reward function {name!r} is not callable")
        return fn
    raise ValueError(f"reward function {name!r} is unknown: use one of "
                     f"{', '.join(sorted(REGISTRY))} or 'module:function'")


class RewardModel:
    """The weighted sum of the recipe's reward functions."""

    def __init__(self, names: list[str], weights: list[float]):
        self.names = list(names)
        self.fns = [resolve(n) for n in names]
        self.weights = list(weights) if weights else [1.0] * len(names)

    def __call__(self, completion: str, answer: str, prompt: str) -> float:
        total = 0.0
        for name, fn, w in zip(self.names, self.fns, self.weights):
            try:
                value = float(fn(completion, answer, prompt))
            except Exception as e:
                raise RuntimeError(f"reward function {name!r} raised {type(e).__name__}: {e} "
                                   f"(prompt {prompt!r}, completion {completion!r})") from e
            total += w * value
        return total
