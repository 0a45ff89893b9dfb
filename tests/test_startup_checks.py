"""Common mistakes become one-line errors at start-up, on every rank, without a hang."""

from __future__ import annotations

import math
import time

import pytest
import torch
from conftest import rank_line, torchrun

from llamarl.config import TrainerConfig
from llamarl.tiny.model import build_model
from llamarl.trainer.parts import check_tokenizer
from llamarl.trainer.policy import collate
from llamarl.trainer.step import PolicyTrainer

RECIPE = "recipes/tiny_grpo_cpu.yaml"


def _launch_fails(tmp_path, cache_dir, *overrides: str) -> str:
    t0 = time.monotonic()
    proc = torchrun(3, ["-m", "llamarl.launch", RECIPE, f"run.output_dir={tmp_path}",
                        "generator.prompts_per_step=8", *overrides],
                    timeout=300, LLAMARL_CACHE=cache_dir)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 120
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_missing_model_path_is_named(tmp_path, cache_dir):
    out = _launch_fails(tmp_path, cache_dir, f"model.path={tmp_path}/no-such-model")
    line = rank_line(out, "rank 0 (trainer 0)")
    assert line, out[-4000:]
    assert "no-such-model" in line and "config.json" in line, line


@pytest.mark.slow
def test_prompt_plus_response_longer_than_the_engine_context(tmp_path, cache_dir):
    out = _launch_fails(tmp_path, cache_dir, "generator.max_model_len=16",
                        "generator.max_new_tokens=12")
    line = rank_line(out, "rank 2 (generator 0)")
    assert line, out[-4000:]
    assert "generator.max_model_len 16" in line and "at least 20" in line, line


def test_engine_context_longer_than_the_model_positions_names_the_key(tmp_path):
    """vLLM's own refusal is a pydantic ValidationError naming none of the recipe's keys."""
    from llamarl.generator.kv_cache import check_model_context

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 128}')
    check_model_context(tmp_path, 128)
    with pytest.raises(ValueError, match=r"generator.max_model_len 256 .* context of 128 "
                                         r"tokens .* <= 128"):
        check_model_context(tmp_path, 256)


def test_tokenizer_without_eos_is_refused():
    _, tok = build_model(0)
    tok.eos_token = None
    with pytest.raises(ValueError, match="no EOS token"):
        check_tokenizer(tok, "some/model")


def test_nan_loss_skips_steps_then_stops_the_run():
    model, tok = build_model(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = PolicyTrainer(model, TrainerConfig(max_bad_steps=3), 10, 1, torch.device("cpu"))
    mb = [collate([([1, 4, 5], [6, 2], [])], tok.pad_token_id)]

    def nan_loss(logp, batch, entropy):
        return (logp * batch.mask).sum() * math.nan, {}

    for _ in range(2):
        out = trainer.step(mb, nan_loss)
        assert out["skipped"] == 1.0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), "a skipped step must not touch the weights"
    with pytest.raises(RuntimeError, match="NaN/inf for 3 steps in a row"):
        trainer.step(mb, nan_loss)


def test_checkpoint_failures_name_the_cause_in_one_line(tmp_path):
    """DCP's CheckpointException holds every rank's traceback; the user gets the cause (a
    shape mismatch when resuming another model, a full disk) and the fix in one line."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from llamarl.trainer.checkpoint import _one_line_errors

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # 1 process
        dcp.save({"model": torch.nn.Linear(4, 4).state_dict()}, checkpoint_id=str(tmp_path))
        with pytest.raises(RuntimeError) as info:
            with _one_line_errors("loading checkpoint", tmp_path):
                dcp.load({"model": torch.nn.Linear(4, 8).state_dict()},
                         checkpoint_id=str(tmp_path))
    msg = str(info.value)
    assert "\n" not in msg and "Size mismatch" in msg and "resume with the model.path" in msg
    with pytest.raises(RuntimeError, match="No space left on device: free disk space"):
        with _one_line_errors("writing checkpoint", tmp_path):
            from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception
            try:
                raise OSError(28, "No space left on device")
            except OSError as e:
                raise CheckpointException("failed", {0: _wrap_exception(e)}) from None
