"""A CPU rank's malloc keeps freed memory for reuse (runtime/allocator.py): a large tensor made
again and again faults its pages in once, not every time; children inherit the setting; a
user's own setting or preloaded allocator is kept."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest
from conftest import ROOT, child_env

from llamarl.runtime import allocator

# Minor page faults of 4 rounds of a 64 MiB tensor made, written and freed, after 20 rounds to
# warm up (torch asks glibc for 64-byte aligned blocks, a little more than a freed block of the
# same size holds, so the first rounds take fresh blocks until freed neighbours merge; then each
# round reuses one), in a fresh process, with or without keep_freed_memory.
PROBE = """
import json, os, resource, sys
import torch
from llamarl.runtime.allocator import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
for _ in range(20):
    torch.empty(16 * 2**20).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    torch.empty(16 * 2**20).fill_(1.0)  # 64 MiB of float32
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"kept": kept, "faults": faults,
                  "env": {k: os.environ.get(k) for k in ("MALLOC_MMAP_MAX_",
                                                         "MALLOC_TRIM_THRESHOLD_")}}))
"""


def _probe(mode: str) -> dict:
    env = child_env()
    for name in (*allocator.SETTINGS, "LD_PRELOAD"):
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_large_tensors_reuse_freed_memory():
    default, kept = _probe("default"), _probe("keep")
    pages = 4 * 64 * 2**20 // 4096  # what 4 fresh 64 MiB blocks fault in, at 4 KiB a page
    assert default["faults"] > pages // 2, default  # glibc's default: fresh pages every time
    assert kept["kept"] is True
    assert kept["faults"] < pages // 50, kept  # the warm-up's blocks, reused
    assert kept["env"] == {"MALLOC_MMAP_MAX_": "0",
                           "MALLOC_TRIM_THRESHOLD_": str(allocator.TRIM_THRESHOLD)}


def test_a_users_setting_or_preloaded_allocator_is_kept():
    env = {"MALLOC_TRIM_THRESHOLD_": "1000"}
    assert allocator.keep_freed_memory(env) is False
    assert env == {"MALLOC_TRIM_THRESHOLD_": "1000"}
    env = {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"}
    assert allocator.keep_freed_memory(env) is False
    assert "MALLOC_MMAP_MAX_" not in env
