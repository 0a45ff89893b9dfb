"""User code named in a recipe as "module:attribute" (reward functions, environments, rollout
sources, advantage estimators, policy losses), imported with a one-line error."""

from __future__ import annotations

import importlib


def import_path(spec: str, what: str):
    """The object `spec` ("module:attribute") names; `what` names the recipe key in errors,
    e.g. "reward function 'my:fn'"."""
    module, _, attr = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} cannot be imported ({e}): check the module is on PYTHONPATH "
                         "and defines it") from None
    return obj
