"""Agent frameworks' own loops on a live engine's gateway (tests/framework_agents.py):
tests/test_agent_frameworks.py reads the JSON this prints.

    python tests/dist/agent_frameworks.py MODEL_DIR  ->  prints JSON (last line)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # framework_agents


def main() -> None:
    from llamarl.config import load_config
    from llamarl.data.prompts import Prompt, PromptFormatter
    from llamarl.generator.engine import Engine
    from llamarl.rollout.source import SourceContext, build_source

    path = sys.argv[1]
    base = ["rollout.source=agent", "reward.functions=[]", "generator.max_new_tokens=8",
            "generator.max_model_len=4096", "generator.kv_cache_gib=0.1",
            "rollout.workers=1", "rollout.agent_timeout_s=120"]
    cfg = load_config(None, base + ["rollout.agent=framework_agents:langgraph_agent"])
    engine = Engine(path, cfg.generator, "float32", 0, True, sequences=8)
    tok = engine.tokenizer
    fmt = PromptFormatter(tok)
    out = {}
    for agent in ("langgraph_agent", "smolagents_agent"):
        cfg = load_config(None, base + [f"rollout.agent=framework_agents:{agent}"])
        src = build_source(SourceContext(cfg, engine, tok, fmt, None, 0))
        prompt = Prompt(tok.encode("Oslo?", add_special_tokens=False), "Oslo?", "",
                        {"prompt": "Weather in Oslo?"})
        try:
            t0 = time.monotonic()
            g = src.collect([prompt], 2, 1.0, 7, version=1, step=0)
            grp = g.groups[0]
            out[agent] = {"rewards": grp.rewards, "metrics": g.metrics,
                          "finish": [s.finish for s in grp.samples],
                          "turns": [s.turns for s in grp.samples],
                          "seconds": time.monotonic() - t0}
        except RuntimeError as e:
            out[agent] = {"error": str(e)}
        finally:
            src.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
