"""Where samples come from: the rollout-source seam.

A `RolloutSource` turns prompts into scored groups of per-token samples (buffer.record.Sample)
with the engine of this generator. Training batches and the held-out evaluation both come
from it; dynamic sampling is a filter around it (rewards/dynamic_sampling.py).

    single_turn   one completion per sample, scored by reward.*      (rollout/single_turn.py)
    multi_turn    episodes of rollout.env with tool calls             (rollout/multi_turn.py)
    module:Class  your own: subclass RolloutSource, implement collect(), name it in the
                  recipe as rollout.source
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llamarl.rewards.scorer import ScoredGroup


@dataclass
class SourceContext:
    """What a source may use: the recipe, this generator's engine (generator/engine.py), the
    policy's tokenizer, the prompt formatter (data/prompts.py), the reward scorer
    (rewards/scorer.py), this engine's index and, when set, the timeline."""

    cfg: object
    engine: object
    tokenizer: object
    formatter: object
    scorer: object
    engine_index: int = 0
    timeline: object = None


@dataclass
class Collected:
    groups: list[ScoredGroup]  # one per prompt, in order, each with .samples and .rewards
    # counts and seconds of this call, summed into the step's metrics (reward_errors,
    # generate_s, tool_calls, ...)
    metrics: dict[str, float] = field(default_factory=dict)


class RolloutSource:
    def __init__(self, ctx: SourceContext):
        self.ctx = ctx

    def collect(self, prompts: list, n: int, temperature: float, seed: int, version: int,
                step: int | None = None, first: int = 0) -> Collected:
        """`n` scored samples of each prompt (data.prompts.Prompt), sampled at `temperature`
        by the engine's current weights (`version`), the sampler seeded with `seed`. `step`:
        the training batch they are for (timeline phases); None for the held-out evaluation
        (no reward shaping). Group j gets index first + j."""
        raise NotImplementedError

    def close(self) -> None:
        """Release workers and processes (called on every exit path)."""


def build_source(ctx: SourceContext) -> RolloutSource:
    """The source that rollout.source names."""
    name = ctx.cfg.rollout.source
    if name == "single_turn":
        from llamarl.rollout.single_turn import SingleTurnSource
        return SingleTurnSource(ctx)
    if name == "multi_turn":
        from llamarl.rollout.multi_turn import MultiTurnSource
        return MultiTurnSource(ctx)
    from llamarl.imports import import_path

    cls = import_path(name, f"rollout.source {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, RolloutSource)):
        raise ValueError(f"rollout.source {name!r} is not a subclass of "
                         "llamarl.rollout.source.RolloutSource")
    return cls(ctx)
