"""The engines start from the trainer's weights, whatever vLLM would read from the checkpoint.

A checkpoint with tied embeddings stored under `lm_head.weight` alone (what
`safetensors.torch.save_model` keeps of the tied pair) loads correctly in transformers (the
trainer) but not in vLLM, which skips `lm_head.*` for a tied model and leaves
`embed_tokens` unset. The engine must still sample from the trainer's policy: the step-0
evaluation reads the policy's true greedy score, and the first step's engine logprobs agree
with the trainer's (mismatch_kl ~ 0). While training, a step whose mismatch is far beyond the
run's usual is reported (MismatchWatch)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, child_env

EVAL_PROMPTS = 16


@pytest.fixture(scope="module")
def lm_head_only_checkpoint(tmp_path_factory) -> Path:
    """The tiny model's warm start (learnt part of the task: greedy score ~0.4), saved with
    safetensors.torch.save_model: its tied embedding kept as `lm_head.weight` only."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from llamarl.trainer.warmstart import run_warm_start

    root = tmp_path_factory.mktemp("lm_head_only")
    warm = root / "warm"
    run_warm_start("reverse", warm, None, torch.device("cpu"), log=lambda m: None)
    out = root / "model"
    out.mkdir()
    for f in warm.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    save_model(AutoModelForCausalLM.from_pretrained(warm), str(out / "model.safetensors"))
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" in names and "model.embed_tokens.weight" not in names, names
    return out


def greedy_reward(model_dir: Path) -> float:
    """The held-out greedy reward of the checkpoint as transformers (the trainer) reads it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llamarl.tiny.task import reverse_reward, sample_examples

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    total = 0.0
    for ex in sample_examples(EVAL_PROMPTS, "eval", seed=0):
        ids = torch.tensor([[tok.bos_token_id] + tok.encode(ex.prompt)])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=12, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        total += reverse_reward(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True),
                                ex.answer)
    return total / EVAL_PROMPTS


@pytest.mark.slow
def test_engine_starts_from_the_trainers_weights(lm_head_only_checkpoint, tmp_path, cache_dir):
    truth = greedy_reward(lm_head_only_checkpoint)
    assert truth > 0.2, "the warm start should have learnt part of the task"
    cmd = [sys.executable, "-m", "llamarl.launch", "recipes/tiny_grpo_cpu.yaml",
           f"model.path={lm_head_only_checkpoint}", "run.steps=1", "run.eval_every=0",
           "generator.prompts_per_step=8", f"data.eval_prompts={EVAL_PROMPTS}",
           f"run.output_dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(LLAMARL_CACHE=cache_dir),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    step0 = json.loads((run / "eval.jsonl").read_text().splitlines()[0])
    assert step0["step"] == 0
    # vLLM's greedy on the trainer's weights: the same tokens but for near-ties
    assert abs(step0["reward_mean_greedy"] - truth) < 0.1, (step0, truth)
    (row,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["mismatch_kl"] < 1e-3, "the engine sampled from other weights than the trainer's"


def test_a_first_sync_that_leaves_engine_parameters_unset_is_an_error():
    import torch

    from llamarl.parallel.weight_receiver import check_complete

    model = torch.nn.Linear(2, 2)
    check_complete(model, {"weight", "bias"})
    check_complete(model, None)  # a load_weights that does not say what it loaded
    with pytest.raises(RuntimeError, match=r"leave 1 engine parameter\(s\) unset \(bias\)"):
        check_complete(model, {"weight"})


def test_mismatch_far_beyond_the_runs_usual_is_reported_once_per_step():
    from llamarl.trainer.metrics import MismatchWatch

    def row(step, kl):
        return {"step": step, "mismatch_kl": kl, "clip_frac": 0.5}

    watch = MismatchWatch(10.0)
    first = watch.check(row(1, 3.5))  # the step 1: engine without the trainer's weights
    assert first is not None and "step 1:" in first and "mismatch_kl 3.5" in first
    assert "\n" not in first and "sync.mismatch_warn" in first
    for step in range(2, 12):  # a bf16 run's usual mismatch
        assert watch.check(row(step, 2e-4)) is None
    assert watch.check(row(12, 0.05)) is None  # 250x the median but under 10x the floor
    assert watch.check(row(13, 0.2)) is not None
    assert MismatchWatch(0.0).check(row(1, 100.0)) is None  # 0: off

