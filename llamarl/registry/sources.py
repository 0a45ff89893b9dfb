"""The rollout-source registry: every name a recipe may give rollout.source, with the import
path of its class (a llamarl.rollout.source.RolloutSource) and what the recipe validation must
know about it before anything is imported. Torch-free: config.py reads it while it checks a
recipe; rollout/source.py's source_class imports the class when a role runs.

    rollout.source   a SOURCES key, or "module:Class" (a RolloutSource of your own: the
                     generator runs it in generator.mode = batch; docs/add_rollout_source.md)

What a source is (episodic or not) and how its per-engine counts become the trainer's metrics
row are declared by the class itself (RolloutSource.episodic, .row_metrics, .eval_metrics).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SourceEntry:
    path: str  # "module:Class"
    # generator.mode = continuous can drive it (generator/continuous.py: single-turn groups
    # of its own, or the episodes of an episodic source's runner)
    continuous: bool = False
    # who scores its samples when it is not reward.* (the reward functions and the reward
    # model): "" = reward.* does, which then needs a function or a model; otherwise the
    # recipe's reward.* and generator.dynamic_sampling are refused, with this as the reason
    scored_by: str = ""


SOURCES = {
    "single_turn": SourceEntry("llamarl.rollout.single_turn:SingleTurnSource", continuous=True),
    "multi_turn": SourceEntry("llamarl.rollout.multi_turn:MultiTurnSource", continuous=True,
                              scored_by="multi-turn episodes are scored by the environment's "
                              "reward()"),
    "agent": SourceEntry("llamarl.rollout.agent_source:AgentSource", continuous=True,
                         scored_by="agent episodes are scored by the agent's return value"),
}


def source_entry(name: str) -> SourceEntry | None:
    """The registry's entry of rollout.source `name`; None for a "module:Class" of the user's."""
    return SOURCES.get(name)


def source_path(name: str) -> str:
    """The "module:Class" import path that rollout.source `name` names."""
    entry = SOURCES.get(name)
    return entry.path if entry is not None else name
