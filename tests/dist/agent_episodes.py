"""A real engine serves agent episodes through its gateway (real HTTP, the real `openai`
client, agents in worker processes): tests/test_agent_gateway.py reads the JSON this prints.

    python tests/dist/agent_episodes.py MODEL_DIR  ->  prints JSON (last line)

Every token the engine sampled is noted as it leaves Engine.step, so the trained sequences
can be compared id for id with what the engine sampled; the trainer then recomputes the
sampled tokens' logprobs from the record alone.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # user_agents


def main() -> None:
    import torch

    from llamarl.config import load_config
    from llamarl.data.prompts import Prompt, PromptFormatter
    from llamarl.generator.engine import Engine
    from llamarl.generator.loop import _to_batch
    from llamarl.rollout.source import SourceContext, build_source
    from llamarl.trainer.policy import load_policy, pad_rollouts, token_logprobs

    path = sys.argv[1]
    base = ["rollout.source=agent", "reward.functions=[]", "generator.max_new_tokens=8",
            "generator.max_model_len=128", "generator.kv_cache_gib=0.05",
            "rollout.workers=2", "rollout.agent_timeout_s=30"]
    cfg = load_config(None, base + ["rollout.agent=user_agents:scenario"])
    engine = Engine(path, cfg.generator, "float32", 0, True, sequences=32)
    sampled: dict[str, list[int]] = {}  # request id -> the ids the engine sampled
    step = engine.step

    def noting_step():
        out = step()
        for rid, c in out:
            sampled[rid] = list(c.token_ids)
        return out

    engine.step = noting_step
    tok = engine.tokenizer
    fmt = PromptFormatter(tok)

    def prompts(kinds):
        return [Prompt(tok.encode("Oslo?", add_special_tokens=False), "Oslo?", "",
                       {"prompt": f"Weather in city {i}?", "kind": k})
                for i, k in enumerate(kinds)]

    kinds = ["chat_tools", "edits_history", "no_model", "fifty_calls", "two_choices",
             "malformed", "stops", "null_content", "generate_tokens", "streams",
             "anthropic_messages", "responses_api", "forced_tools"]
    source = build_source(SourceContext(cfg, engine, tok, fmt, None, 0))
    try:
        got = source.collect(prompts(kinds), 2, 1.0, 1234, version=3, step=0)
    finally:
        source.close()
    out = {"metrics": got.metrics}
    for kind, grp in zip(kinds, got.groups):
        out[kind] = {"rewards": grp.rewards,
                     "finish": [s.finish for s in grp.samples],
                     "turns": [s.turns for s in grp.samples],
                     "sampled": [[i for i, v in zip(s.token_ids, _mask(s)) if v]
                                 for s in grp.samples]}
    # the engine's sampled ids, per episode, in call order (request id = episode:call:choice)
    by_episode: dict[int, list[tuple[int, int, list[int]]]] = {}
    for rid, ids in sampled.items():
        e, c, i = map(int, rid.split(":"))
        by_episode.setdefault(e, []).append((c, i, ids))
    out["engine"] = {str(e): [ids for _, _, ids in sorted(v)] for e, v in by_episode.items()}

    batch = _to_batch(got.groups, 0, 0, len(kinds))
    full = pad_rollouts(batch, tok.pad_token_id)
    model = load_policy(path, "float32")
    with torch.no_grad():
        logp, _ = token_logprobs(model, full, 1.0)
    m = full.mask > 0
    out["max_abs_diff"] = float((logp - full.old_logp)[m].abs().max()) if m.any() else None
    out["sampled_tokens"] = int(m.sum())
    out["versions"] = sorted(set(batch.token_version[batch.loss_mask > 0].tolist()))

    # an async agent; failing agents (one per worker: os._exit kills its worker's episodes);
    # every episode failing; each with a gateway of its own
    failing = ["exits", "hangs", "raises", "not_a_number", "no_model"]
    # docs/agents.md's example agent, copied out of the page as written
    import re
    import tempfile

    page = (Path(__file__).resolve().parents[2] / "docs" / "agents.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", page, re.DOTALL)
                 if b.startswith("# my_agents.py"))
    mods = Path(tempfile.mkdtemp(prefix="llamarl-doc-agent-"))
    (mods / "my_agents.py").write_text(block)
    sys.path.insert(0, str(mods))  # (spawned agent workers start with this sys.path)
    doc = [("my_agents:weather_agent", "docs_example", ["x"], 2, [])]
    try:
        import agents  # noqa: F401 - the OpenAI Agents SDK, when installed (the dev extra)
        sdk = [("user_agents:sdk_agent", "sdk", ["x"], 2, []),
               ("user_agents:sdk_responses_agent", "sdk_responses", ["x"], 2, [])]
    except ImportError:
        sdk = []
    for agent, key, kinds, n, extra in (
            *doc, *sdk,
            ("user_agents:async_agent", "async", ["x", "y"], 2, []),
            ("user_agents:stream_dropped", "stream_dropped", ["x"], 2, []),
            ("user_agents:scenario", "failing", failing, 1, ["rollout.workers=5",
                                                 "rollout.agent_timeout_s=2"]),
            ("user_agents:raises", "all_fail", ["x"], 2, ["rollout.workers=1"])):
        cfg2 = load_config(None, base + [f"rollout.agent={agent}", *extra])
        src = build_source(SourceContext(cfg2, engine, tok, fmt, None, 0))
        try:
            t0 = time.monotonic()
            g = src.collect(prompts(kinds), n, 1.0, 99, version=4, step=0)
            out[key] = {"rewards": [grp.rewards for grp in g.groups], "metrics": g.metrics,
                        "finish": [[s.finish for s in grp.samples] for grp in g.groups],
                        "seconds": time.monotonic() - t0, "restarts": src.pool.restarts}
        except RuntimeError as e:
            out[key] = {"error": str(e)}
        finally:
            src.close()
    import shutil

    shutil.rmtree(mods, ignore_errors=True)
    print(json.dumps(out))


def _mask(sample):
    mask = []
    for n, v in zip(sample.segments, sample.versions):
        mask += [v >= 0] * n
    return mask


if __name__ == "__main__":
    main()
