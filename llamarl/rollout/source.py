"""Where samples come from: the rollout-source seam.

A `RolloutSource` turns prompts into scored groups of per-token samples (buffer.record.Sample)
with the engine of this generator. Training batches and the held-out evaluation both come
from it; dynamic sampling is a filter around it (rewards/dynamic_sampling.py).

    single_turn   one completion per sample, scored by reward.*      (rollout/single_turn.py)
    multi_turn    episodes of rollout.env with tool calls             (rollout/multi_turn.py)
    agent         episodes of an OpenAI-client agent, rollout.agent,  (rollout/agent_source.py)
                  served by the engine's gateway (llamarl/gateway)
    module:Class  your own: subclass RolloutSource, implement collect(), name it in the
                  recipe as rollout.source (docs/add_rollout_source.md)

The names are llamarl/registry/sources.py's. A source class says what it is (episodic) and
how its counts reach the metrics rows (row_metrics, eval_metrics), so neither the trainer nor
the generator asks which source runs.
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
    # Episodes (multi_turn, agent): the source has a runner(temperature, spans) that
    # continuous generation drives group by group (generator/continuous.py's EpisodePool),
    # on an instance of its own apart from the evaluation's. A source that is not episodic
    # is sampled by collect() alone.
    episodic: bool = False

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

    @classmethod
    def row_metrics(cls, parts: list[dict]) -> dict:
        """This source's entries of the trainer's metrics row, from one step's rollout
        batches: `parts` holds each engine's Collected.metrics of the batch (summed over its
        collect calls; generate_s, reward_s, reward_errors and reward_timeouts, which every
        row reports, taken out). Called on trainer 0, where no source is built."""
        return {}

    @classmethod
    def eval_metrics(cls, parts: list[dict], samples: int) -> dict:
        """This source's entries of an eval.jsonl row, from each held-out slot's sampled
        Collected.metrics; `samples`: the sampled samples (episodes) of all the slots."""
        return {}


def source_class(name: str) -> type[RolloutSource]:
    """The class that rollout.source `name` names (llamarl/registry/sources.py, or the
    user's "module:Class")."""
    from llamarl.imports import import_path
    from llamarl.registry.sources import source_path

    cls = import_path(source_path(name), f"rollout.source {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, RolloutSource)):
        raise ValueError(f"rollout.source {name!r} is not a subclass of "
                         "llamarl.rollout.source.RolloutSource")
    return cls


def build_source(ctx: SourceContext) -> RolloutSource:
    """The source that rollout.source names."""
    return source_class(ctx.cfg.rollout.source)(ctx)
