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
        "metrics": got.metrics}))


if __name__ == "__main__":
    main()
