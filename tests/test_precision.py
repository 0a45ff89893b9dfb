"""model.dtype = auto (llamarl/models/precision.py): resolved when the recipe is loaded, to
bfloat16 where the host runs its products fast and float32 elsewhere; a half precision on a CPU
without them gets one warning line."""

from __future__ import annotations

import pytest

from llamarl.config import load_config
from llamarl.models import precision


@pytest.mark.parametrize("gpu,fast,want", [(False, False, "float32"), (False, True, "bfloat16"),
                                           (True, False, "bfloat16")])
def test_auto_resolves_by_the_host(monkeypatch, gpu, fast, want):
    monkeypatch.setattr(precision, "has_gpu", lambda: gpu)
    monkeypatch.setattr(precision, "cpu_bfloat16_is_fast", lambda: fast)
    assert precision.resolve_dtype("auto") == want
    cfg = load_config("recipes/smollm2_add_cpu.yaml", ["run.steps=1"])
    assert cfg.model.dtype == want  # every reader after the load sees a concrete dtype
    for named in ("float32", "bfloat16", "float16"):  # a named dtype is kept
        assert precision.resolve_dtype(named) == named
        assert load_config(None, [f"model.dtype={named}"]).model.dtype == named


def test_a_slow_half_precision_is_named_with_its_fix(monkeypatch):
    monkeypatch.setattr(precision, "has_gpu", lambda: False)
    monkeypatch.setattr(precision, "cpu_bfloat16_is_fast", lambda: False)
    line = precision.slow_dtype_warning("bfloat16")
    assert line is not None and "\n" not in line
    assert "model.dtype=bfloat16" in line and "model.dtype=auto" in line
    assert precision.slow_dtype_warning("float32") is None
    monkeypatch.setattr(precision, "cpu_bfloat16_is_fast", lambda: True)
    assert precision.slow_dtype_warning("bfloat16") is None


def test_this_host_is_read_without_error():
    assert isinstance(precision.cpu_bfloat16_is_fast(), bool)
    assert precision.resolve_dtype("auto") in ("float32", "bfloat16")


def test_a_wrong_dtype_names_the_choices():
    with pytest.raises(ValueError, match="auto"):
        load_config(None, ["model.dtype=bf16"])
