"""torchrun --nproc-per-node 2: the distillation teacher on the trainer group, loaded and
FSDP2-sharded as the trainer loads it (trainer/teacher.py); rank r scores its uneven share of a
multi-turn batch (rank 0: 5 rows, rank 1: 4) in padded, packed and shared-prompt micro-batches,
then runs one on_policy_distill update of the sharded policy with the teacher equal to it.
Rank r saves to $OUT.r: its rows, the teacher's logprobs per layout, the update's stats, and
whether the policy's weights are unchanged.

Env: OUT, MODEL_DIR (a tiny model directory: the policy and the teacher)."""

import os
import sys

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_distill import LAYOUTS, multi_turn_batch  # noqa: E402
from trainer_world import exit_process, trainer_world  # noqa: E402

from llamarl.config import load_config  # noqa: E402
from llamarl.tiny.model import build_tokenizer  # noqa: E402
from llamarl.trainer.policy import load_policy, pad_rollouts, shard_for_training  # noqa: E402
from llamarl.trainer.rl_step import MicroBatching, _filler, no_grad_passes, policy_step  # noqa
from llamarl.trainer.step import PolicyTrainer  # noqa: E402
from llamarl.trainer.teacher import load_teacher  # noqa: E402


def full(model):
    return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}


if __name__ == "__main__":
    rank, world, mesh, device = trainer_world()
    path = os.environ["MODEL_DIR"]
    base = ["algorithm.name=on_policy_distill", f"algorithm.teacher_path={path}",
            "trainer.ranks=2", "trainer.micro_batch_size=2", "trainer.lr=1e-2"]
    cfg = load_config(None, base)
    teacher = load_teacher(cfg, path, build_tokenizer(), path, mesh, device)
    rows = [list(range(5)), list(range(5, 9))][rank]
    mine = multi_turn_batch().select(torch.tensor(rows))
    out = {"rows": rows, "sharded": all(isinstance(p, DTensor) for p in teacher.parameters())}
    tb, blank = pad_rollouts(mine, 0), _filler(mine, 0)
    for layout, extra in LAYOUTS.items():
        mb = MicroBatching.of(load_config(None, base + extra), teacher)
        logps, _ = no_grad_passes(tb, blank, mb, {"teacher": teacher}, device, 1.0)
        out[layout] = logps["teacher"]

    model = load_policy(path, "float32")
    shard_for_training(model, mesh, cfg.trainer, torch.float32)
    trainer = PolicyTrainer(model, cfg.trainer, 1, world, device)
    before = full(model)
    stats = policy_step(trainer, mine, cfg, 0, teacher=teacher)
    after = full(model)
    out.update(kl_teacher=stats["kl_teacher"], grad_norm=stats["grad_norm"],
               unchanged=all(torch.equal(before[k], after[k]) for k in before))
    torch.save(out, f"{os.environ['OUT']}.{rank}")
    exit_process()
