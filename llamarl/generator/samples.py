"""Samples a person can read: the evaluation's and a few of each training batch's, as JSON lines.

    RUN_DIR/samples/eval_<step>.jsonl   every held-out sample of the evaluation after `step`
                                         (kind "sampled" at the training temperature, and
                                         "greedy"), written by the engine that aggregates it
    RUN_DIR/samples/train.jsonl          the first run.samples_per_step samples of each
                                         training batch (slot 0's), appended step by step
                                         (asynchronous runs: batches made ahead of the
                                         trainer's last step too, never trained on)

One row per sample:

    {"step", "kind", "prompt", "completion", "tokens", "reward", "finish_reason", "answer"}

`prompt` and `completion` are decoded with their special tokens (a chat template's markers
and the EOS that stopped a sample, e.g. `<|im_end|>`, show); `tokens` counts the tokens the
policy sampled (in a multi-turn episode, its turns, not the tool results); `reward` is the
sample's total reward.
"""

from __future__ import annotations

import json
from pathlib import Path


def sample_rows(groups, tokenizer, step: int, kind: str, limit: int | None = None) -> list[dict]:
    """Rows of the samples of `groups` (ScoredGroup, rewards/scorer.py), in order, at most
    `limit` of them."""
    rows: list[dict] = []
    for grp in groups:
        for s, reward in zip(grp.samples, grp.rewards):
            if limit is not None and len(rows) >= limit:
                return rows
            rows.append({
                "step": step, "kind": kind,
                "prompt": tokenizer.decode(s.token_ids[:s.prompt_len]),
                "completion": tokenizer.decode(s.token_ids[s.prompt_len:]),
                "tokens": len(s.logprobs), "reward": float(reward),
                "finish_reason": s.finish, "answer": grp.prompt.answer})
    return rows


def append_rows(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
