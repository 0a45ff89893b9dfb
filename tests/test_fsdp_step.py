"""FSDP2 on 2 real gloo ranks takes the same RL update as one unsharded process (GRPO), or as
one FSDP2 rank (PPO with its critic, a KL reward penalty and two epochs, the two ranks with
gradient checkpointing)."""

import pytest
import torch
from conftest import DIST, torchrun
from test_buffer import make_batch

from llamarl.config import load_config
from llamarl.tiny.model import build_model
from llamarl.trainer.rl_step import policy_step
from llamarl.trainer.step import PolicyTrainer

CFG = ["trainer.micro_batch_size=3", "trainer.lr=1e-2", "trainer.ranks=2",
       "trainer.share_prompts=false"]  # as tests/dist/fsdp_policy_step.py


def launch(nproc: int, out, **env) -> dict:
    """The step of tests/dist/fsdp_policy_step.py on `nproc` ranks: its saved results."""
    proc = torchrun(nproc, [str(DIST / "fsdp_policy_step.py")], timeout=300, OUT=out, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("placed", [False, True],
                         ids=["own_storage", "in_send_buffers_gathered_once"])
def test_two_rank_fsdp2_step_matches_single_process(tmp_path, placed):
    """in_send_buffers_gathered_once: the shards live in a weight sender's send buffers
    (place_shards), and each block keeps its gathered parameters through the step's three
    micro-batches (trainer.keep_gathered_params) instead of gathering them for every forward
    and backward."""
    extra = {"PLACE": "1", "EXTRA": "trainer.keep_gathered_params=true"} if placed else {}
    sharded = launch(2, tmp_path / "fsdp.pt", **extra)
    micro_batches = 3  # 8 samples a rank, 3 a micro-batch
    gathers = sharded["block_gathers"]  # per decoder block, in the step
    if placed:
        assert gathers == [1, 1], gathers
    else:  # the first block again for backward; the last keeps them (apply_fsdp)
        assert gathers == [2 * micro_batches, micro_batches], gathers
    # after the step, sharded, with apply_fsdp's settings back for what runs next
    assert sharded["blocks_resharded"]
    assert sharded["reshard_after_forward"] == [True, False]
    assert sharded["reshard_after_backward"] == [True, True]
    if placed:  # every shard without padding is moved (rank 1 holds a padded one: copied)
        counts = sharded["placed_even_slots"]  # per rank: moved, without padding, slots
        assert all(moved == even > 0 for moved, even, _ in counts), counts
        assert counts[0][0] == counts[0][2] and counts[1][0] < counts[1][2], counts
        assert sharded["in_slots"]

    cfg = load_config(None, CFG)
    model, tok = build_model(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = PolicyTrainer(model, cfg.trainer, 1, 1, torch.device("cpu"))
    stats = policy_step(trainer, make_batch(4, 4, seed=5), cfg, tok.pad_token_id)

    assert abs(stats["loss"] - sharded["stats"]["loss"]) < 1e-5
    assert abs(stats["grad_norm"] - sharded["stats"]["grad_norm"]) < 1e-4
    moved = 0.0
    for name, ref in model.state_dict().items():
        assert torch.allclose(sharded["state"][name], ref, atol=2e-5), name
        moved = max(moved, (ref - before[name]).abs().max().item())
    assert moved > 1e-3, "the step must actually change the weights"


def test_ppo_update_is_the_same_on_one_and_two_ranks(tmp_path, tiny_model_dir):
    """PPO with its critic, a KL reward penalty and two epochs: one FSDP2 rank, and two ranks
    with trainer.gradient_checkpointing (recomputing each block's activations in backward
    changes no gradient), take the same update."""
    extra = ("algorithm.name=ppo algorithm.epochs=2 algorithm.kl_coef=0.1 "
             "algorithm.kl_mode=reward algorithm.kl_estimator=k1 critic.lr=1e-2")
    one = launch(1, tmp_path / "one.pt", MODEL_DIR=tiny_model_dir, EXTRA=extra)
    two = launch(2, tmp_path / "two.pt", MODEL_DIR=tiny_model_dir,
                 EXTRA=extra + " trainer.gradient_checkpointing=true")
    assert two["checkpointing"] and not one["checkpointing"]
    for key in ("loss", "value_loss", "kl_ref", "grad_norm", "critic_grad_norm"):
        assert two["stats"][key] == pytest.approx(one["stats"][key], rel=1e-5, abs=1e-6), key
    # Adam divides gradients by their own RMS: the critic's backbone gradients are tiny in the
    # second epoch (its head was zero in the first), so the summation order of 1 vs 2 ranks
    # shows up at ~1% of one lr-sized (1e-2) step. The policy's weights differ by up to 2.8e-5
    # (0.3% of a step) on an AMD EPYC machine, 2e-5 elsewhere: 1e-4 is 1% of a step, while a
    # wrong update is off by a whole one.
    for part, atol in (("state", 1e-4), ("critic", 2e-4)):
        for name, ref in one[part].items():
            assert torch.allclose(two[part][name], ref, atol=atol), (part, name)
    assert one["stats"]["value_loss"] > 0 and one["stats"]["kl_ref"] != 0
    head = one["critic"]["score.weight"]
    assert head.abs().max() > 0, "the critic's value head (zero at start) must have learned"
