"""torchrun --nproc-per-node 2: the trainer-side reward model FSDP2-sharded on the gloo trainer
group scores two rollout shares: "uneven" (rank 0: 5 sequences = 3 micro-batches of 2, rank 1:
2 sequences = 1 micro-batch, then 2 fillers) and "one_empty" (rank 0: 3 sequences, rank 1: no
batch, only fillers). Rank r saves its batches, scores and the cross-rank mean to $OUT.r.

Env: RM_DIR (a tiny reward model directory with the tiny policy's tokenizer), OUT."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_buffer import make_batch  # noqa: E402

from llamarl.tiny.model import build_tokenizer  # noqa: E402
from llamarl.trainer.reward_model import TrainerRewardModel  # noqa: E402

SHARES = {"uneven": ([0, 1, 2, 3, 4], [5, 6]), "one_empty": ([2, 5, 7], None)}

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rm = TrainerRewardModel(os.environ["RM_DIR"], build_tokenizer(), "float32",
                            torch.device("cpu"), mesh)
    full = make_batch(2, 4, seed=3)  # 8 sequences of varied lengths
    out = {"sharded": all(isinstance(p, DTensor) for p in rm.model.parameters())}
    for case, shares in SHARES.items():
        rows = shares[rank]
        batch = full.select(rows) if rows is not None else None
        scores = rm.score(batch, micro_batch_size=2)
        mean = rm.add_scores(batch, 1.0, micro_batch_size=2)["reward/reward_model"]
        out[case] = {"batch": batch.columns() if batch is not None else None,
                     "scores": scores, "mean": mean}
    torch.save(out, f"{os.environ['OUT']}.{rank}")
    dist.destroy_process_group()
