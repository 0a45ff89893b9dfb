"""The trainer group of a torchrun-launched test script, as `trainer.loop.init_trainer_group`
builds it: DEVICE=cpu (gloo, the default) or cuda (one GPU per rank; NCCL for CUDA tensors,
gloo for the CPU statistics)."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from llamarl.trainer.loop import TRAINER_BACKEND


def trainer_world():
    """Initialise the default group; returns (rank, world size, 1-D mesh, device)."""
    kind = os.environ.get("DEVICE", "cpu")
    if kind == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(TRAINER_BACKEND[kind])
    torch.set_num_threads(1)
    mesh = init_device_mesh(kind, (dist.get_world_size(),))
    device = torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else \
        torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), mesh, device


def exit_process() -> None:
    """End a test rank the way llamarl.launch does: destroy the process groups, flush, and
    `os._exit(0)`. A normal interpreter exit after destroy_process_group aborted about one run
    in 30 (torch 2.13, gloo: "terminate called without an active exception" during
    finalization, with no Python frame left), failing a test whose work had succeeded."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
