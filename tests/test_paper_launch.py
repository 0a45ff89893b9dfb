"""A launch on paper at 16-1024 GPUs (issue 69's budgets): the launcher's own config
(load_config of the 7B recipe), layout (compute_layout) and communication plan (comm_plan), for
(trainer ranks, engines, tp) in the four layouts below, on NCCL, without starting a process
(bench/paper_launch.py prints the same counts). Per rank nothing may grow with the product of
the two rank counts:

* prompts_per_step: the smallest the recipe accepts is a multiple of the trainer ranks, not of
  engines x trainer ranks;
* NCCL communicators on an engine's GPU: a weight group, a resharding group and its command
  stream at most (rollout pairs are gloo); on a trainer's GPU at most one weight group and one
  resharding group per tp rank; in the job, at most one per rank;
* an engine rank's weight-sync memory: a pool of receive buffers, not the model (tp 1);
* the watchdog's store keys: a constant per rank a second.

Before this issue the same counts were (bench/results/paper_launch_baseline.json): 196,608
prompts a step at 1024 GPUs, 512 groups on an engine's GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from paper_launch import DATA, RANKS_PER_NODE, RECIPE, count  # noqa: E402

from llamarl.config import load_config  # noqa: E402
from llamarl.generator.gpu_memory import GIB, sync_need_bytes  # noqa: E402
from llamarl.parallel.plan import comm_plan  # noqa: E402
from llamarl.parallel.weight_plan import TensorMeta  # noqa: E402
from llamarl.runtime.layout import compute_layout  # noqa: E402
from llamarl.runtime.watchdog import HEARTBEAT_S, store_keys_per_sweep  # noqa: E402

LAYOUTS = [(8, 8, 1), (32, 32, 1), (256, 768, 1), (256, 96, 8)]


@pytest.mark.parametrize("T, E, tp", LAYOUTS)
def test_prompts_and_communicators_per_gpu_do_not_grow_with_e_times_t(T, E, tp):
    row = count(T, E, tp, "auto")
    P = row["smallest_prompts_per_step"]
    assert P % T == 0 and P <= max(E, T) + T, row
    assert row["most_nccl_on_an_engine_gpu"] <= (1 if tp == 1 else 3), row  # + reshard, commands
    assert row["most_nccl_on_a_trainer_gpu"] <= 1 + (tp if tp > 1 else 0), row
    assert row["job_nccl_communicators"] <= row["world"], row
    # rollout channels (gloo): an engine sends to at most ceil(T / E) + 1 trainer ranks
    assert row["engine_leader_groups"]["rollouts"] <= -(-T // E) + 1, row
    assert row["trainer_rank_groups"]["rollouts"] <= -(-E // T) + 1, row


def _qwen25_7b_metas() -> list[TensorMeta]:
    """Qwen2.5-7B's tensors as one sender of whole tensors sends them (bfloat16): 28 layers,
    hidden 3584, MLP 18944, 28 query and 4 key/value heads of 128, vocabulary 152064,
    untied head."""
    h, f, v, kv = 3584, 18944, 152064, 4 * 128
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
              "model.norm.weight": (h,)}
    for i in range(28):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
                       p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
                       p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f),
                       p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    return [TensorMeta(n, "torch.bfloat16", s, -1, 0) for n, s in shapes.items()]


@pytest.mark.parametrize("T, E, tp", [(8, 8, 1), (32, 32, 1), (256, 768, 1)])
def test_an_engines_sync_memory_is_a_pool_not_the_model(T, E, tp):
    """The plan's senders (one on NCCL: trainer 0, whole tensors) into the recipe's pool."""
    cfg = load_config(RECIPE, [*DATA, f"trainer.ranks={T}", f"generator.engines={E}",
                               f"generator.tp={tp}", f"generator.prompts_per_step={E}"])
    plan = comm_plan(cfg, compute_layout(T + E * tp, RANKS_PER_NODE, T, E, tp), "nccl")
    assert plan.senders == 1
    metas = _qwen25_7b_metas()
    model = sum(m.numel * 2 for m in metas)
    assert 14 * GIB < model < 15 * GIB  # (7.6e9 parameters)
    need = sync_need_bytes([metas], cfg.sync.bucket_mb, cfg.sync.solo_mb,
                           cfg.sync.receive_buffers, tp, cfg.sync.reshard)
    assert need <= 2.5 * GIB, need / GIB  # K buckets (the embedding and head travel alone)


def test_the_watchdogs_store_load_is_linear_in_the_ranks():
    """Keys a second on the job's one store: a constant per rank (the bench measures ~6 at
    64-1024 ranks: bench/results/watchdog_store_load.json), 10 x N at most."""
    for T, E, tp in LAYOUTS:
        world = T + E * tp
        assert store_keys_per_sweep() / HEARTBEAT_S * world <= 10 * world
