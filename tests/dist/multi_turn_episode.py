"""A real engine runs 3-turn episodes through the multi-turn source; the trainer's logprobs,
recomputed from the record alone, must match the engine's on every sampled token.

    python tests/dist/multi_turn_episode.py WARM_START_DIR  ->  prints JSON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # user_envs


def main() -> None:
    import torch

    from llamarl.config import load_config
    from llamarl.data.prompts import PromptFormatter
    from llamarl.generator.engine import Engine
    from llamarl.generator.loop import _to_batch
    from llamarl.rollout.source import SourceContext, build_source
    from llamarl.tiny.task import sample_examples
    from llamarl.trainer.policy import load_policy, pad_rollouts, token_logprobs

    path = sys.argv[1]
    cfg = load_config(None, ["rollout.source=multi_turn", "rollout.env=user_envs:ThreeTurnEnv",
                             "reward.functions=[]", "rollout.tool_format=compact",
                             "rollout.max_turns=3", "generator.max_new_tokens=8",
                             "generator.max_model_len=64", "generator.kv_cache_gib=0.05"])
    engine = Engine(path, cfg.generator, "float32", 0, True, sequences=32)
    fmt = PromptFormatter(engine.tokenizer)
    source = build_source(SourceContext(cfg, engine, engine.tokenizer, fmt, None, 0))
    try:
        prompts = fmt.encode(sample_examples(8, "eval", 0))
        got = source.collect(prompts, 4, 1.0, 1234, version=7, step=0)
        aborted = _abort_a_group(source, prompts)
    finally:
        source.close()
    batch = _to_batch(got.groups, 0, 0, 8)
    full = pad_rollouts(batch, engine.tokenizer.pad_token_id)
    model = load_policy(path, "float32")
    with torch.no_grad():
        logp, _ = token_logprobs(model, full, 1.0)
    m = full.mask > 0
    obs = batch.token_version < 0
    tok = engine.tokenizer
    print(json.dumps({
        "turns": batch.turns.tolist(), "finish": batch.finish.tolist(),
        "sampled_tokens": int(m.sum()),
        "max_abs_diff": float((logp - full.old_logp)[m].abs().max()),
        "masked_tokens_with_weight": int(batch.loss_mask[obs].sum()),
        "versions": sorted(set(batch.token_version[~obs].tolist())),
        "policy_version": sorted(set(batch.policy_version.tolist())),
        "example": tok.decode(batch.rows()[0].tolist()),
        "metrics": got.metrics, "abort": aborted}))


def _abort_a_group(source, prompts) -> dict:
    """Continuous mode's runner (spans, as EpisodePool runs it): two groups of 4 episodes, the
    first stopped after a few steps (its slot handed back); the second still completes, and
    nothing of the first is left in the engine, the runner or the environment workers."""
    runner = source.runner(1.0, spans=True)
    engine = source.ctx.engine
    engine.begin(99)
    runner.add(0, prompts[0], 4)
    runner.add(1, prompts[1], 4)
    first = {str(eid) for eid in runner.groups[0][1]}
    returned = []
    for _ in range(200):  # until a turn of the first group generates
        returned += [g.index for g in runner.step(0)]
        if any(r.split(":")[0] in first for r in engine._requests):
            break
    running_before = engine.running
    runner.abort(0)
    running_after = engine.running
    for _ in range(2000):
        if not runner.groups and source.pool.pending == 0:
            break
        returned += [g.index for g in runner.step(0)]
    return {"returned": returned, "running_before": running_before,
            "running_after": running_after, "live": runner.live, "engine_running": engine.running,
            "calls_left": len(runner.calls), "pending": source.pool.pending}


if __name__ == "__main__":
    main()
