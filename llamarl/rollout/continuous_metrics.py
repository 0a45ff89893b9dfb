"""The metrics row of continuous generation (generator.mode = continuous): how each engine's
Meter counts (generator/continuous.py, a batch's info["rollout"] with "continuous" set) are
summed into one trainer step's row. Torch-free: trainer 0 reads it to write the row."""

from __future__ import annotations


def continuous_metrics(parts: list[dict]) -> dict:
    """Engine time shares, sequences in flight and version spread over the engines whose batch
    was generated continuously; {} when none was."""
    parts = [p for p in parts if p.get("continuous")]
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
