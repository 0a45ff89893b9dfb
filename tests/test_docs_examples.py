"""The worked examples of docs/add_algorithm.md, docs/add_reward.md and
docs/add_rollout_source.md, copied out of the pages as written and trained with through the
launcher, all three in one launch (in the same launch: a KV cache that holds fewer sequences
than a batch, which the engine's preemption makes do with)."""

from __future__ import annotations

import json
import re
import sys

from conftest import ROOT, torchrun


def code_block(page: str, first_line: str) -> str:
    text = (ROOT / page).read_text()
    for block in re.findall(r"```python\n(.*?)```", text, re.DOTALL):
        if block.startswith(first_line):
            return block
    raise AssertionError(f"{page} has no python block starting with {first_line!r}")


def test_docs_examples_train(tmp_path, cache_dir):
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "my_algorithms.py").write_text(code_block("docs/add_algorithm.md",
                                                      "# my_algorithms.py"))
    (mods / "my_rewards.py").write_text(code_block("docs/add_reward.md", "# my_rewards.py"))
    (mods / "my_sources.py").write_text(code_block("docs/add_rollout_source.md",
                                                   "# my_sources.py"))
    out = tmp_path / "runs"
    proc = torchrun(3, ["-m", "llamarl.launch", "recipes/tiny_grpo_cpu.yaml", "run.steps=2",
                        "run.eval_every=0", "data.eval_prompts=16", f"run.output_dir={out}",
                        "algorithm.advantage=my_algorithms:median_baseline",
                        "algorithm.policy_loss=my_algorithms:reinforce",
                        "reward.functions=[reverse_match,my_rewards:length_match]",
                        "reward.weights=[1.0,0.2]", "generator.kv_cache_gib=0.01",
                        "rollout.source=my_sources:TruncationCountingSource"],
                    timeout=600, LLAMARL_CACHE=str(cache_dir), PYTHONPATH=str(mods))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    run = next(p for p in out.iterdir() if p.is_dir())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert all("reward/my_rewards:length_match" in r for r in rows)
    assert all(r["clip_frac"] == 0.0 and r["grad_norm"] > 0 for r in rows)  # REINFORCE: no clip
    # the example source sampled every batch and declared its own entries of both rows
    assert all(0.0 <= r["truncated_share"] <= 1.0 for r in rows), rows
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert evals and all(0.0 <= e["truncated_share"] <= 1.0 for e in evals), evals
    # a cache that holds 81 of a batch's 512 sequences: the engine says what a whole batch
    # would need, and the run completes (sequences preempted and recomputed as it fills)
    line = next(x for x in proc.stderr.splitlines() if "KV cache 0.01 GiB" in x)
    assert "holds 81 of them" in line and "generator.kv_cache_gib=0.07" in line, line


def test_rollout_source_example_declares_itself(tmp_path, monkeypatch):
    """docs/add_rollout_source.md's source, named as a recipe names it: a RolloutSource that is
    not episodic and sums its engines' counts into its own metrics-row entry."""
    (tmp_path / "my_sources.py").write_text(code_block("docs/add_rollout_source.md",
                                                       "# my_sources.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_sources", raising=False)
    from llamarl.config import load_config
    from llamarl.rollout.source import source_class

    spec = "my_sources:TruncationCountingSource"
    load_config(None, [f"rollout.source={spec}"])  # the recipe validation accepts the name
    cls = source_class(spec)
    assert cls.episodic is False
    parts = [{"truncated": 3.0, "completions": 8.0}, {"truncated": 1.0, "completions": 8.0}]
    assert cls.row_metrics(parts) == {"truncated_share": 0.25}
    assert cls.eval_metrics(parts, 16) == {"truncated_share": 0.25}
