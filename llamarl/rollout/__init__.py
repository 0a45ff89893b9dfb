"""Where samples come from: the rollout-source seam (source.py), single-turn sampling, and
multi-turn episodes of an Environment (environment.py) with tool calls."""

from llamarl.rollout.environment import Environment
from llamarl.rollout.source import RolloutSource

__all__ = ["Environment", "RolloutSource"]
