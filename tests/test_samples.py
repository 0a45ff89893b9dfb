"""generator/samples.py: a batch's samples as rows a person can read."""

from __future__ import annotations

import json

from llamarl.buffer.record import Sample
from llamarl.data.prompts import Prompt
from llamarl.generator.samples import append_rows, sample_rows
from llamarl.rewards.scorer import ScoredGroup
from llamarl.tiny.model import build_tokenizer


def group(tok, prompt: str, completions: list[tuple[str, bool]], rewards: list[float]):
    ids = [tok.bos_token_id] + tok.encode(prompt)
    samples = []
    for text, stopped in completions:
        s = Sample(finish="stop" if stopped else "length")
        s.add_context(ids)
        out = tok.encode(text) + ([tok.eos_token_id] if stopped else [])
        s.add_sampled(out, [-0.5] * len(out), 3)
        samples.append(s)
    return ScoredGroup(Prompt(ids, prompt, prompt[:-1][::-1]), [None] * len(samples), rewards,
                       samples=samples)


def test_rows_show_prompt_completion_tokens_reward_and_finish(tmp_path):
    tok = build_tokenizer()
    groups = [group(tok, "abc=", [("cba", True), ("cbaaaa", False)], [1.0, 0.5]),
              group(tok, "de=", [("ed", True), ("e", True)], [1.0, 0.5])]
    rows = sample_rows(groups, tok, step=7, kind="train", limit=3)
    assert rows[0] == {"step": 7, "kind": "train", "prompt": "<bos>abc=",
                       "completion": "cba<eos>", "tokens": 4, "reward": 1.0,
                       "finish_reason": "stop", "answer": "cba"}
    assert rows[1]["completion"] == "cbaaaa" and rows[1]["finish_reason"] == "length"
    assert rows[1]["tokens"] == 6 and rows[1]["reward"] == 0.5
    assert len(rows) == 3 and rows[2]["prompt"] == "<bos>de="
    append_rows(tmp_path / "samples" / "train.jsonl", rows)
    append_rows(tmp_path / "samples" / "train.jsonl", rows[:1])
    lines = (tmp_path / "samples" / "train.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == rows + rows[:1]
