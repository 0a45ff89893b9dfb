"""The metrics rows of episodic sources: how the episode counts of each engine's rollout batch
(the runners' metrics, rollout/multi_turn.py and rollout/agent_source.py) are summed into one
trainer step's row. MultiTurnSource.row_metrics and AgentSource.row_metrics are these; the
held-out evaluation's tool calls per episode is MultiTurnSource.eval_metrics."""

from __future__ import annotations


def episode_metrics(parts: list[dict]) -> dict:
    """Turns, tool calls, errors and environment time of one step's episodes, over the engines
    whose batch holds episodes; {} when none does."""
    parts = [p for p in parts if "episodes" in p]
    if not parts:
        return {}
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
    }


def agent_metrics(parts: list[dict]) -> dict:
    """rollout.source = agent: the episode metrics, then model calls per episode, prefix
    breaks, calls spliced onto sampled ids, sampled tokens left out of the trained sequence,
    failed episodes, refused calls, the gateway's 4xx answers and their most common reason
    (gateway_4xx, gateway_4xx_reason: e.g. 400_invalid_prompt), and the mean of each metric
    the agent returned (agent_<name>)."""
    row = episode_metrics(parts)
    parts = [p for p in parts if "episodes" in p]
    if not parts or "model_calls" not in parts[0]:
        return row
    tot = {k: sum(p.get(k, 0.0) for p in parts) for k in parts[0]}
    episodes = max(tot["episodes"], 1.0)
    # the gateway's 4xx answers by reason (AgentRunner.count_refusals), over every engine
    refusals: dict[str, float] = {}
    for p in parts:
        for k, v in p.items():
            if k.startswith("gateway_4xx/"):
                refusals[k.removeprefix("gateway_4xx/")] = \
                    refusals.get(k.removeprefix("gateway_4xx/"), 0.0) + v
    return {**row,
            "gateway_4xx": int(sum(refusals.values())),
            "gateway_4xx_reason": max(refusals, key=refusals.get) if refusals else "",
            "model_calls_per_episode": tot["model_calls"] / episodes,
            "prefix_breaks": int(tot["prefix_breaks"]),
            "spliced_calls": int(tot["spliced_calls"]),
            "dropped_sampled_tokens": int(tot["dropped_sampled_tokens"]),
            "agent_errors": int(tot["agent_errors"]),
            "agent_timeouts": int(tot["agent_timeouts"]),
            "refused_calls": int(tot["refused_calls"]),
            # replies calling a tool the request did not offer, returned as text
            "unknown_tool_calls": int(tot.get("unknown_tool_calls", 0)),
            **{k: v / episodes for k, v in tot.items() if k.startswith("agent_")
               and k not in ("agent_errors", "agent_timeouts")}}


def tool_calls_per_episode(parts: list[dict], episodes: int) -> dict:
    """The held-out evaluation's tool calls per sampled episode, over the slots."""
    return {"tool_calls_per_episode": sum(p.get("tool_calls", 0.0) for p in parts)
            / max(episodes, 1)}
