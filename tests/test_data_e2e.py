"""End to end with a dataset file: recipes/tiny_grpo_jsonl_cpu.yaml (the reverse task as JSONL
with its own field names, a held-out file of its own), its training file replaced by one with a
few malformed rows, trained for 3 steps through the real launcher."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from conftest import ROOT, child_env

from llamarl.tiny.task import sample_examples

pytestmark = pytest.mark.slow
RECIPE = "recipes/tiny_grpo_jsonl_cpu.yaml"  # (so test_e2e.py does not launch it again)


def test_jsonl_dataset_with_malformed_rows_trains_and_counts_them(tmp_path, cache_dir):
    lines = [json.dumps({"question": e.prompt, "target": e.answer})
             for e in sample_examples(300, "train", 5)]
    lines[10] = '{"question": "abc=", "target": '  # cut short: not JSON
    lines[20] = json.dumps({"question": "", "target": "x"})  # empty prompt
    lines[30] = json.dumps({"question": "abc="})  # no answer
    data = tmp_path / "reverse.jsonl"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "llamarl.launch", RECIPE, "run.steps=3", "run.checkpoint_every=3",
           f"run.output_dir={out}", "generator.prompts_per_step=8", "data.eval_prompts=16",
           "run.eval_every=0", f"data.path={data}"]  # (the recipe's fields: question, target)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(LLAMARL_CACHE=cache_dir),
                          capture_output=True, text=True, timeout=600)
    print(f"jsonl e2e: {time.monotonic() - t0:.1f} s")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"{data}: skipped 3 malformed row(s)" in proc.stderr
    assert "first: line 11: not valid JSON" in proc.stderr
    assert "held out from recipes/data/reverse_eval.jsonl" in proc.stderr, proc.stderr[-3000:]
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["data_bad_rows"] == 3 and r["data_epoch"] == 0 for r in rows)
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["prompts"] for e in evals] == [16, 16]
    meta = json.loads((run / "checkpoints" / "step_00000003" / "meta.json").read_text())
    (state,) = meta["data_state"].values()  # one engine: 3 batches of 8 prompts drawn
    assert state["loader"]["root"]["it_state"]["source"] == {"epoch": 0, "index": 24}
