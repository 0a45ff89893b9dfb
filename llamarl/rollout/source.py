"""Where samples come from: the rollout-source seam.

A `RolloutSource` turns prompts into scored groups of per-token samples (buffer.record.Sample)
with the engine of this generator. Training batches and the held-out evaluation both come
from it; dynamic sampling is a filter around it (rewards/dynamic_sampling.py).

    single_turn   one completion per sample, scored by reward.*      (rollout/single_turn.py)
    multi_turn    episodes of rollout.env with tool calls             (rollout/multi_turn.py)
    agent         episodes of an OpenAI-client agent, rollout.agent,  (rollout/agent_source.py)
                  served by the engine's gateway (llamarl/gateway)
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
    if name == "agent":
        from llamarl.rollout.agent_source import AgentSource
        return AgentSource(ctx)
    from llamarl.imports import import_path

    cls = import_path(name, f"rollout.source {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, RolloutSource)):
        raise ValueError(f"rollout.source {name!r} is not a subclass of "
                         "llamarl.rollout.source.RolloutSource")
    return cls(ctx)


def rollout_metrics(infos: list[dict]) -> dict:
    """Multi-turn episode metrics and continuous-generation metrics of one trainer step from
    the rollout batches' info (one per engine); {} for single-turn batch generation."""
    out = _continuous_metrics([i["rollout"] for i in infos
                               if i.get("rollout", {}).get("continuous")])
    parts = [i["rollout"] for i in infos if "episodes" in i.get("rollout", {})]
    if not parts:
        return out
    return {**out, **_episode_metrics(parts)}


def _continuous_metrics(parts: list[dict]) -> dict:
    """generator.mode = continuous (generator/continuous.py), over the engines."""
    if not parts:
        return {}
    tot = {k: sum(p[k] for p in parts) for k in parts[0]}
    samples = max(tot["samples"], 1.0)
    return {
        # the engine stepped for this share of the time since its previous batch
        "engine_busy_share": tot["engine_busy_s"] / max(tot["wall_s"], 1e-9),
        "engine_load_share": tot["engine_load_s"] / max(tot["wall_s"], 1e-9),
        "engine_held_share": tot["engine_held_s"] / max(tot["wall_s"], 1e-9),
        # of the busy share: stepping while a batch's worth of groups was complete but a
        # running one was due in the batch (long responses at their staleness deadline)
        "engine_due_share": tot["engine_due_s"] / max(tot["wall_s"], 1e-9),
        "in_flight_mean": tot["in_flight_mean"] / len(parts),  # sequences per engine step
        # max - min policy version among a sample's tokens, and the samples with more than one
        "version_spread_mean": tot["version_spread_sum"] / samples,
        "spanning_share": tot["spanning_samples"] / samples,
        "stale_groups_discarded": int(tot["stale_groups_discarded"]),
        "recomputed_tokens": int(tot["recomputed_tokens"]),  # re-prefilled after weight loads
    }


def _episode_metrics(parts: list[dict]) -> dict:
    tot = {k: sum(p.get(k, 0.0) for p in parts) for k in parts[0]}
    episodes = max(tot["episodes"], 1.0)
    return {
        "turns_per_episode": tot["turns"] / episodes,
        "tool_calls_per_episode": tot["tool_calls"] / episodes,
        "tool_errors": int(tot["tool_errors"]), "malformed_calls": int(tot["malformed"]),
        "env_errors": int(tot["env_errors"]), "env_timeouts": int(tot["env_timeouts"]),
        # episodes restored in a restarted environment worker (rollout/env_worker.py)
        "env_replayed": int(tot.get("env_replayed", 0)),
        "env_s": max(p.get("env_s", 0.0) for p in parts),
        # the engine stepped for this share of the collection (it idles only while every
        # live episode waits for its environment)
        "engine_busy_share": tot["engine_busy_s"] / max(tot["collect_s"], 1e-9),
        "masked_response_share": 1.0 - tot["sampled_tokens"] / max(tot["response_tokens"], 1.0),
        # why episodes ended: stop (final answer), length (a turn hit max_new_tokens),
        # max_turns, context (rollout.max_tokens), env_error (rollout.on_error = zero)
        **{k.replace("finish_", "episodes_"): int(v) for k, v in tot.items()
           if k.startswith("finish_")},
        **_agent_metrics(tot, episodes),
    }


def _agent_metrics(tot: dict, episodes: float) -> dict:
    """rollout.source = agent (rollout/agent_source.py, rollout/capture.py): model calls per
    episode, prefix breaks, calls spliced onto sampled ids, sampled tokens left out of the
    trained sequence, failed episodes, refused calls, and the mean of each metric the agent
    returned (agent_<name>)."""
    if "model_calls" not in tot:
        return {}
    return {"model_calls_per_episode": tot["model_calls"] / episodes,
            "prefix_breaks": int(tot["prefix_breaks"]),
            "spliced_calls": int(tot["spliced_calls"]),
            "dropped_sampled_tokens": int(tot["dropped_sampled_tokens"]),
            "agent_errors": int(tot["agent_errors"]),
            "agent_timeouts": int(tot["agent_timeouts"]),
            "refused_calls": int(tot["refused_calls"]),
            **{k: v / episodes for k, v in tot.items() if k.startswith("agent_")
               and k not in ("agent_errors", "agent_timeouts")}}
