"""torchrun --nproc-per-node 2: one GRPO step with FSDP2 on the gloo trainer group; rank 0
saves the updated full weights to $OUT for comparison with an unsharded single-process step."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_buffer import make_batch  # noqa: E402

from llamarl.buffer.record import split_groups  # noqa: E402
from llamarl.config import load_config  # noqa: E402
from llamarl.parallel.fsdp import apply_fsdp  # noqa: E402
from llamarl.tiny.model import build_model  # noqa: E402
from llamarl.trainer.loop import policy_step  # noqa: E402
from llamarl.trainer.step import PolicyTrainer  # noqa: E402

CFG = ["trainer.micro_batch_size=3", "trainer.lr=1e-2", "trainer.ranks=2"]

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cfg = load_config(None, CFG)
    model, tok = build_model(seed=0)
    apply_fsdp(model, init_device_mesh("cpu", (world,)), torch.float32)
    trainer = PolicyTrainer(model, cfg.trainer, 1, world, torch.device("cpu"))
    batch = split_groups(make_batch(4, 4, seed=5), world)[rank]
    stats = policy_step(trainer, batch, cfg, tok.pad_token_id)
    state = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save({"state": state, "stats": stats}, os.environ["OUT"])
    dist.destroy_process_group()
