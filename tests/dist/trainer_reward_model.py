"""torchrun --nproc-per-node N: the trainer-side reward model FSDP2-sharded on the trainer group
scores rollout shares; rank r saves its batches, scores and the cross-rank mean to $OUT.r.

N = 2: "uneven" (rank 0: 5 sequences = 3 micro-batches of 2, rank 1: 2 sequences = 1
micro-batch, then 2 fillers) and "one_empty" (rank 0: 3 sequences, rank 1: no batch, only
fillers). N = 1: "all" 8 sequences.

Env: RM_DIR (a tiny reward model directory with the tiny policy's tokenizer), OUT, DEVICE (cpu,
the default, on gloo; or cuda: one GPU per rank, NCCL + gloo), DTYPE (model.dtype, float32)."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_buffer import make_batch  # noqa: E402
from trainer_world import exit_process, trainer_world  # noqa: E402

from llamarl.tiny.model import build_tokenizer  # noqa: E402
from llamarl.trainer.reward_model import TrainerRewardModel  # noqa: E402

SHARES = {1: {"all": [list(range(8))]},
          2: {"uneven": [[0, 1, 2, 3, 4], [5, 6]], "one_empty": [[2, 5, 7], None]}}

if __name__ == "__main__":
    rank, world, mesh, device = trainer_world()
    rm = TrainerRewardModel(os.environ["RM_DIR"], build_tokenizer(),
                            os.environ.get("DTYPE", "float32"), device, mesh)
    full = make_batch(2, 4, seed=3)  # 8 sequences of varied lengths
    out = {"sharded": all(isinstance(p, DTensor) for p in rm.model.parameters())}
    for case, shares in SHARES[world].items():
        rows = shares[rank]
        batch = full.select(rows) if rows is not None else None
        scores = rm.score(batch, micro_batch_size=2)
        mean = rm.add_scores(batch, 1.0, micro_batch_size=2)["reward/reward_model"]
        out[case] = {"batch": batch.columns() if batch is not None else None,
                     "scores": scores, "mean": mean}
    torch.save(out, f"{os.environ['OUT']}.{rank}")
    exit_process()
