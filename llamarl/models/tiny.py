"""The embedded tiny model by name (model.path tiny:<task>): its warm start's recipe and the
cache entry it is kept in. The warm start itself is trained by trainer/warmstart.py; the key
covers everything that shapes the result, so a change to any of it trains a new one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from llamarl.models import cache_root
from llamarl.tiny import lookup
from llamarl.tiny import task as tasks
from llamarl.tiny.model import build_model

# per task: SFT steps (the multi-turn format takes longer to learn than reversal)
SFT_STEPS = {"reverse": 30, "lookup": 600}
SFT_BATCH = 64  # global sequences per step
SFT_LR = 2e-3
SEED = 1234
VERSION = 1  # bump when the recipe below changes
# lookup: the share of warm-start episodes that use the tool (the others guess), so the
# policy starts out calling it sometimes and RL has the rest to learn
LOOKUP_TOOL_SHARE = 0.3


def warm_start_dir(task: str) -> Path:
    model, tok = build_model(SEED)
    shape = {"alphabet": tasks.ALPHABET, "lens": [tasks.MIN_LEN, tasks.MAX_LEN]}
    if task == "lookup":  # a new key, so the reverse task's cache path is unchanged
        shape = {"keys": lookup.KEYS, "n": [lookup.MIN_KEYS, lookup.MAX_KEYS],
                 "tool_share": LOOKUP_TOOL_SHARE}
    blob = json.dumps({"config": model.config.to_dict(), "vocab": tok.get_vocab(), "task": task,
                       **shape, "steps": SFT_STEPS.get(task, 0), "batch": SFT_BATCH,
                       "lr": SFT_LR, "seed": SEED, "version": VERSION}, sort_keys=True,
                      default=str)
    return cache_root() / f"tiny-{task}-{hashlib.sha1(blob.encode()).hexdigest()[:10]}"
