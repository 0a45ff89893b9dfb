"""Workarounds for vLLM's CPU build (llamarl/generator/cpu_fixes.py). The prepack one is guarded
by the weight-sync parity tests; the shared-memory names of tp > 1 engines here, and end to end
by tests/test_tp.py (two tp 2 engines starting together on one host, one of them killed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llamarl.buffer.shm import segment_prefix
from llamarl.generator.cpu_fixes import (
    PREFIX_ENV,
    _count_greater_or_equal,
    cpu_shm_prefix,
    eager_logprob_ranks,
    unique_cpu_shm_names,
    unlink_cpu_shm,
)

cpu_communicator = pytest.importorskip("vllm.distributed.device_communicators.cpu_communicator")


class _Communicator:  # what make_group_name reads of vLLM's CpuCommunicator
    unique_name = "tp:0"
    ranks = [0, 1]


def test_each_engine_names_its_own_segments(monkeypatch):
    """vLLM names the segments after VLLM_DIST_IDENT, "//" for every external_launcher engine:
    two engines on a host asked for the same segment (EEXIST). The name now starts with the
    run's segment prefix and the engine's own rendezvous port, and has no "/" (POSIX)."""
    unique_cpu_shm_names()
    unique_cpu_shm_names()  # idempotent: one prefix, not two
    monkeypatch.setenv("VLLM_DIST_IDENT", "//")
    names = []
    for port in ("29600", "29601"):
        monkeypatch.setenv(PREFIX_ENV, cpu_shm_prefix("run1", port))
        names.append(cpu_communicator._CPUSHMDistributed.make_group_name(_Communicator()))
    assert names[0] != names[1]
    for port, name in zip(("29600", "29601"), names):
        assert name.startswith(cpu_shm_prefix("run1", port)) and "/" not in name
        assert name.startswith(segment_prefix("run1"))  # (swept with the run's segments)
        assert name.endswith("tp:0-[0-1]-cpushm")


def test_unlink_removes_only_that_engines_segments():
    run = f"t{os.getpid()}"
    mine = Path("/dev/shm") / f"{cpu_shm_prefix(run, 29600)}tp:0-[0-1]-cpushm_0"
    other = Path("/dev/shm") / f"{cpu_shm_prefix(run, 29601)}tp:0-[0-1]-cpushm_0"
    try:
        mine.write_bytes(b"x")
        other.write_bytes(b"x")
        unlink_cpu_shm(cpu_shm_prefix(run, 29600))
        assert not mine.exists() and other.exists()
    finally:
        mine.unlink(missing_ok=True)
        other.unlink(missing_ok=True)


def test_sampled_token_ranks_are_counted_without_compiling(monkeypatch):
    """On CPU the sampler's rank count runs eagerly (no 2.2 s compile in each engine's first
    batch) and counts as vLLM's compiled function does."""
    import torch
    from vllm.v1.sample import ops, sampler

    original = ops.logprobs.batched_count_greater_than
    monkeypatch.setattr(sampler, "batched_count_greater_than", original)
    eager_logprob_ranks()
    assert sampler.batched_count_greater_than is _count_greater_or_equal
    x = torch.randn(5, 40).log_softmax(-1)
    values = x.gather(-1, torch.tensor([[3], [0], [39], [7], [7]]))
    uncompiled = getattr(original, "_torchdynamo_orig_callable", original)
    assert torch.equal(_count_greater_or_equal(x, values), uncompiled(x, values))
    assert torch.equal(_count_greater_or_equal(x, values),
                       (x[:, None, :] >= values[:, :, None]).sum(-1).flatten())
