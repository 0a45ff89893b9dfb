"""Which GPU(s) each rank uses, decided before anything in the process touches CUDA.

A trainer rank uses GPU `local_rank` of what its node shows it (`cuda:<local_rank mod count>`).
A generator rank must do the same, but vLLM does not let it: vLLM 0.32's single-process
executor (a tp = 1 engine) takes the engine's local rank from the device string, which its
DeviceConfig always sets to a bare `cuda`, so every engine's worker picks `cuda:0`
(v1/executor/uniproc_executor.py `_distributed_args`, v1/worker/gpu_worker.py); `LLM()` has no
argument that names another device. So each generator process is shown only its engine's own
GPUs, through CUDA_VISIBLE_DEVICES, set here before CUDA is initialised:

    tp = 1:  CUDA_VISIBLE_DEVICES = <its GPU>              the worker's cuda:0 is its own GPU
    tp > 1:  CUDA_VISIBLE_DEVICES = <the engine's tp GPUs>, LOCAL_RANK (vLLM's) = tp rank
             (every tp rank of an engine sits on one node, next to each other: the layout)

Where the node already shows the process a single GPU (Slurm's --gpus-per-task=1, or a
container with one GPU) nothing is changed: that GPU is cuda:0 and the engine's local rank is 0
(vLLM asserts local_rank < device_count). Each engine then also runs vLLM's tensor-parallel
all-reduce without its custom (CUDA IPC) kernel, which needs the peers' GPUs visible
(generator/engine.py).

Why not vLLM's external launcher with LOCAL_RANK = the node's index alone: vLLM 0.32 names its
compile cache `rank_<rank>_<dp rank>` without the device, so the engines of rank 0 on GPUs 4-7
would share one cache of graphs compiled for one device. With each engine's GPUs renumbered
from 0 the compiled graphs are the same for every engine; each engine still gets a cache
directory of its own (VLLM_CACHE_ROOT, below), so no two engines write one at once.

The decision travels to the rest of the process (runtime.pick_device) and to the processes it
starts (a supervised engine, a replacement's tp ranks) in GPU_INDEX_ENV.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from llamarl.runtime.layout import Layout

VISIBLE = "CUDA_VISIBLE_DEVICES"
GPU_INDEX_ENV = "LLAMARL_GPU_INDEX"  # this process's device index (cuda:N), once placed
VLLM_CACHE = "VLLM_CACHE_ROOT"


@dataclass(frozen=True)
class Placement:
    """Where one rank runs: `visible` is the CUDA_VISIBLE_DEVICES to set (None: leave the
    environment as it is) and `index` the device it then uses (cuda:index)."""

    visible: str | None
    index: int
    sees_engine: bool = True  # a tp > 1 engine's rank sees every GPU of its engine


def node_gpus(environ: dict) -> list[str]:
    """The GPUs this process may use on its node, by the names CUDA_VISIBLE_DEVICES takes:
    its entries when set, else 0 .. n-1 with n counted through NVML (torch.cuda.device_count
    asks NVML first, which does not initialise CUDA, so CUDA_VISIBLE_DEVICES set afterwards
    still takes effect)."""
    if environ.get(VISIBLE) is not None:
        return [g.strip() for g in environ[VISIBLE].split(",") if g.strip()]
    import torch

    if not torch.cuda._is_compiled():
        return []
    return [str(i) for i in range(torch.cuda.device_count())]


def check_enough_gpus(layout: Layout, rank: int, gpus: list[str]) -> None:
    """ValueError when rank `rank`'s node runs more ranks than it shows GPUs: `place` would
    otherwise wrap the ranks modulo the count, and an engine would land on a trainer's GPU
    (vLLM's "Free memory on device" error) or two trainers share one, said by nothing.

    One GPU shown is not checked: under Slurm's --gpus-per-task=1 every task sees its own GPU
    alone (so one shown is no count of the node's), and on a one-GPU machine a trainer and an
    engine share it on purpose (the engine takes its share: generator.gpu_memory_utilization)."""
    n = len(gpus)
    if n > 1 and layout.ranks_per_node > n:
        raise ValueError(
            f"rank {rank} on node {layout.node_of(rank)}: {layout.ranks_per_node} ranks a node "
            f"but the node shows {n} GPUs ({VISIBLE}={','.join(gpus)}); each rank needs a GPU "
            f"of its own: launch --nproc-per-node {n} per node (with trainer.ranks and "
            f"generator.engines x generator.tp to match), show the node "
            f"{layout.ranks_per_node} GPUs, or hide them ({VISIBLE}=) to run on the CPU")


def check_mask_took_effect(rank: int, node: int, visible: str, device_count: int) -> None:
    """RuntimeError when the process sees `device_count` GPUs after placement set
    CUDA_VISIBLE_DEVICES to `visible`: CUDA started before the mask (counting the GPUs fell
    back from NVML to cudaGetDeviceCount, which starts the driver), so the mask is ignored and
    vLLM's worker would take the node's GPU 0, another rank's, without a word."""
    entries = [g for g in visible.split(",") if g.strip()]
    if device_count != len(entries):
        raise RuntimeError(
            f"rank {rank} on node {node}: placed on GPU(s) {VISIBLE}={visible} "
            f"({len(entries)}) but CUDA shows it {device_count}: the CUDA driver started "
            f"before the mask (NVML could not count the GPUs, so torch asked CUDA); make NVML "
            f"work in this process (libnvidia-ml.so on the library path) or set {VISIBLE} "
            "per rank before the launch (Slurm --gpus-per-task=1)")


def place(layout: Layout, rank: int, local_rank: int, gpus: list[str]) -> Placement:
    """The placement of global rank `rank` (local rank `local_rank` on its node, which shows
    the process `gpus`). A pure function (tests/test_gpu_placement.py). ValueError when the
    node shows fewer GPUs than it runs ranks (check_enough_gpus)."""
    assert gpus, "no GPU to place on"
    check_enough_gpus(layout, rank, gpus)
    role = layout.role_of(rank)
    n = len(gpus)
    if role.role == "trainer":
        return Placement(None, local_rank % n)
    if n == 1:  # one GPU shown to this task (Slurm --gpus-per-task=1): it is the rank's own
        return Placement(None, 0, sees_engine=layout.tp == 1)
    first = local_rank - role.tp_rank  # the engine's first tp rank on this node
    own = [gpus[(first + k) % n] for k in range(layout.tp)]
    return Placement(",".join(own), role.tp_rank)


def apply_placement(layout: Layout, rank: int, local_rank: int,
                    environ: dict | None = None) -> Placement | None:
    """Place this process (once: a process started by a placed one inherits its placement),
    setting CUDA_VISIBLE_DEVICES for a generator rank. None on a machine without GPUs."""
    env = os.environ if environ is None else environ
    if GPU_INDEX_ENV in env:
        return Placement(env.get(VISIBLE), int(env[GPU_INDEX_ENV]))
    gpus = node_gpus(env)
    if not gpus:
        return None
    placement = place(layout, rank, local_rank, gpus)
    if placement.visible is not None:
        env[VISIBLE] = placement.visible
    env[GPU_INDEX_ENV] = str(placement.index)
    role = layout.role_of(rank)
    if role.role == "generator":
        # vLLM's compile cache, one per engine (see the module's docstring)
        env[VLLM_CACHE] = str(Path(vllm_cache_root(env)) / f"llamarl-engine{role.index}")
    return placement


def vllm_cache_root(environ: dict) -> str:
    """vLLM's own cache root for `environ` (vllm/envs.py VLLM_CACHE_ROOT's default):
    VLLM_CACHE_ROOT when set, else $XDG_CACHE_HOME/vllm, else ~/.cache/vllm."""
    if environ.get(VLLM_CACHE):
        return os.path.expanduser(environ[VLLM_CACHE])
    xdg = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return os.path.expanduser(os.path.join(xdg, "vllm"))


def check_placed(placement: Placement, rank: int, node: int, device_count: int) -> None:
    """After placement, in a GPU rank: the mask it set must be what CUDA shows
    (check_mask_took_effect). `device_count` is torch.cuda.device_count(), read by the caller
    (through NVML: it starts no CUDA context). A count of 0 is a torch without CUDA (a CPU
    run under a CUDA_VISIBLE_DEVICES left in the environment): nothing to check."""
    if placement.visible is not None and device_count > 0:
        check_mask_took_effect(rank, node, placement.visible, device_count)


def placed_index(environ: dict | None = None) -> int | None:
    """The device index apply_placement chose for this process, if it ran."""
    value = (os.environ if environ is None else environ).get(GPU_INDEX_ENV)
    return None if value is None else int(value)
