"""The launcher's bound on oneDNN's primitive cache (runtime/onednn.py) takes effect in a rank
that sets it after importing torch, and a value the user set is kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT, child_env

from llamarl.models.precision import cpu_bfloat16_is_fast
from llamarl.runtime.onednn import (
    PRIMITIVE_CACHE_CAPACITY,
    PRIMITIVE_CACHE_ENV,
    cap_primitive_cache,
)

# One bfloat16 matmul shape, then more other shapes than the bound, then the first again:
# oneDNN's verbose log says whether its primitive was still cached (create:cache_hit) or had
# been evicted and was made anew (create:cache_miss).
PROBE = f"""
import sys
import torch
from llamarl.runtime.onednn import cap_primitive_cache
if sys.argv[1] == "cap":
    cap_primitive_cache()  # after importing torch, before the first bfloat16 matmul
torch.set_num_threads(1)
w = torch.randn(64, 32, dtype=torch.bfloat16)
for m in [8, *range(9, 9 + 2 * {PRIMITIVE_CACHE_CAPACITY}), 8]:
    torch.randn(m, 32, dtype=torch.bfloat16) @ w.t()
"""


def _last_creation(mode: str) -> str:
    env = child_env(ONEDNN_VERBOSE=2)
    env.pop(PRIMITIVE_CACHE_ENV, None)
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    created = [line.split(",")[3] for line in out.splitlines()
               if line.startswith("onednn_verbose") and ",create:" in line]
    assert len(created) >= 2, out[-2000:]
    return created[-1]


@pytest.mark.skipif(not cpu_bfloat16_is_fast(),
                    reason="this CPU runs bfloat16 products without oneDNN (AVX2 only: "
                    "llamarl/models/precision.py), so there is no primitive cache to bound")
def test_the_bound_evicts_old_shapes_and_the_default_does_not():
    assert _last_creation("cap") == "create:cache_miss"
    assert _last_creation("default") == "create:cache_hit"


def test_a_value_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv(PRIMITIVE_CACHE_ENV, "")
    monkeypatch.delenv(PRIMITIVE_CACHE_ENV)
    cap_primitive_cache()
    assert os.environ[PRIMITIVE_CACHE_ENV] == PRIMITIVE_CACHE_CAPACITY
    monkeypatch.setenv(PRIMITIVE_CACHE_ENV, "1024")
    cap_primitive_cache()
    assert os.environ[PRIMITIVE_CACHE_ENV] == "1024"
