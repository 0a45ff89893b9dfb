"""torchrun --nproc-per-node N: one RL update with FSDP2 on the gloo trainer group; rank 0
saves the updated full weights (policy, and PPO's critic) and the stats to $OUT, for comparison
with an unsharded or differently sharded run.

Env: OUT (output file), EXTRA (space-separated recipe overrides), MODEL_DIR (a HF directory of
the tiny model, needed for PPO's critic and a reference model), DEVICE (cpu, the default, on
gloo; or cuda: one GPU per rank on NCCL)."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_buffer import make_batch  # noqa: E402
from trainer_world import exit_process, trainer_world  # noqa: E402

from llamarl.buffer.record import split_groups  # noqa: E402
from llamarl.config import load_config  # noqa: E402
from llamarl.parallel.fsdp import apply_fsdp  # noqa: E402
from llamarl.tiny.model import build_model  # noqa: E402
from llamarl.trainer.critic import build_critic  # noqa: E402
from llamarl.trainer.loop import load_reference  # noqa: E402
from llamarl.trainer.rl_step import policy_step  # noqa: E402
from llamarl.trainer.step import PolicyTrainer  # noqa: E402

CFG = ["trainer.micro_batch_size=3", "trainer.lr=1e-2", "trainer.ranks=2"]


def full(model):
    return {k: v.full_tensor().detach().cpu().clone() for k, v in model.state_dict().items()}


if __name__ == "__main__":
    rank, world, mesh, device = trainer_world()
    cfg = load_config(None, CFG + os.environ.get("EXTRA", "").split())
    model, tok = build_model(seed=0)
    model.to(device)
    apply_fsdp(model, mesh, torch.float32,
               gradient_checkpointing=cfg.trainer.gradient_checkpointing)
    steps = cfg.algorithm.epochs * cfg.algorithm.mini_batches
    trainer = PolicyTrainer(model, cfg.trainer, steps, world, device)
    path = os.environ.get("MODEL_DIR", "")
    critic = build_critic(cfg, path, mesh, device, steps, world) if cfg.algorithm.name == "ppo" \
        else None
    reference = load_reference(cfg, path, mesh, device)
    batch = split_groups(make_batch(4, 4, seed=5), world)[rank]
    stats = policy_step(trainer, batch, cfg, tok.pad_token_id, reference=reference,
                        critic=critic)
    out = {"state": full(model), "stats": stats,
           "checkpointing": bool(getattr(model, "is_gradient_checkpointing", False))}
    if critic is not None:
        out["critic"] = full(critic.model)
    if rank == 0:
        torch.save(out, os.environ["OUT"])
    exit_process()
