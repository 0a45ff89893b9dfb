"""PPO's pieces against values worked out by hand: per-token rewards, GAE, whitening, the
clipped value loss; the critic's loading; epochs x mini-batches of optimizer steps."""

import copy
import dataclasses

import pytest
import torch
from test_buffer import make_batch

from llamarl.algorithms.gae import (
    gae,
    last_token_mask,
    masked_whiten,
    reward_to_go,
    token_rewards,
    value_loss,
)
from llamarl.config import load_config
from llamarl.tiny.model import build_model, save_hf_dir
from llamarl.trainer.critic import load_critic, values
from llamarl.trainer.policy import collate
from llamarl.trainer.rl_step import policy_step
from llamarl.trainer.step import PolicyTrainer

MASK = torch.tensor([[0.0, 1.0, 1.0, 1.0]])  # one prompt position, three completion tokens
VALUES = torch.tensor([[9.0, 0.5, 0.2, 0.1]])  # 9.0 sits on the prompt: must be ignored


def test_token_rewards_put_the_outcome_on_the_last_token_and_the_kl_on_every_token():
    kl = torch.tensor([[5.0, 0.1, 0.2, 0.3]])
    r = token_rewards(torch.tensor([1.0]), MASK, kl, kl_coef=0.5)
    assert torch.allclose(r, torch.tensor([[0.0, -0.05, -0.1, 0.85]]))
    assert torch.equal(last_token_mask(torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])),
                       torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))


def test_gae_by_hand():
    r = token_rewards(torch.tensor([1.0]), MASK)
    # gamma 1, lambda 0.5: delta_3 = 1 - 0.1 = 0.9, delta_2 = 0.1 - 0.2 = -0.1,
    # delta_1 = 0.2 - 0.5 = -0.3; A_3 = 0.9, A_2 = -0.1 + 0.5 * 0.9 = 0.35,
    # A_1 = -0.3 + 0.5 * 0.35 = -0.125; returns = A + V = 0.375, 0.55, 1.0
    adv, ret = gae(r, VALUES, MASK, gamma=1.0, lam=0.5)
    assert torch.allclose(adv, torch.tensor([[0.0, -0.125, 0.35, 0.9]]))
    assert torch.allclose(ret, torch.tensor([[0.0, 0.375, 0.55, 1.0]]))
    # lambda = 1: the returns are the discounted Monte-Carlo returns 0.81, 0.9, 1
    adv, ret = gae(r, VALUES, MASK, gamma=0.9, lam=1.0)
    assert torch.allclose(ret, torch.tensor([[0.0, 0.81, 0.9, 1.0]]))
    assert torch.allclose(adv, torch.tensor([[0.0, 0.31, 0.7, 0.9]]))


def test_reward_to_go_and_whitening():
    assert torch.equal(reward_to_go(torch.tensor([[7.0, 1.0, 2.0, 3.0]]), MASK),
                       torch.tensor([[0.0, 6.0, 5.0, 3.0]]))
    x = torch.tensor([[100.0, 1.0, 2.0, 3.0]])
    w = masked_whiten(x, MASK, eps=0.0)  # mean 2, population std sqrt(2/3)
    assert torch.allclose(w, torch.tensor([[0.0, -1.0, 0.0, 1.0]]) / (2 / 3) ** 0.5)


def test_clipped_value_loss_by_hand():
    v = torch.tensor([1.0, 0.6])
    v_old = torch.tensor([0.5, 0.5])
    ret = torch.tensor([2.0, 0.0])
    # token 0: unclipped (1 - 2)^2 = 1, clipped V = 0.7: (0.7 - 2)^2 = 1.69 -> 0.845 (clipped)
    # token 1: V moved 0.1 < 0.2: both branches (0.6)^2 = 0.36 -> 0.18
    loss, clipped = value_loss(v, v_old, ret, clip=0.2)
    assert torch.allclose(loss, torch.tensor([0.845, 0.18]))
    assert clipped.tolist() == [True, False]
    loss, _ = value_loss(v, v_old, ret, clip=0.0)
    assert torch.allclose(loss, torch.tensor([0.5, 0.18]))


def test_critic_starts_at_zero_from_a_policy_and_keeps_a_trained_head(tmp_path):
    model, tok = build_model(seed=0)
    save_hf_dir(tmp_path / "policy", model.state_dict(), model.config, tok)
    critic = load_critic(str(tmp_path / "policy"), "float32")
    tb = collate([([1, 5, 6], [7, 8], [-0.1, -0.2])], tok.pad_token_id)
    assert values(critic, tb).shape == (1, 4)
    assert torch.equal(values(critic, tb), torch.zeros(1, 4))
    # the policy's transformer weights are the critic's backbone
    assert torch.equal(critic.model.layers[0].mlp.up_proj.weight,
                       model.model.layers[0].mlp.up_proj.weight)
    # a reward model (sequence classifier, head `score`) keeps its head as the value head
    from transformers import Qwen2ForSequenceClassification

    cfg = copy.deepcopy(model.config)
    cfg.num_labels, cfg.pad_token_id = 1, tok.pad_token_id
    rm = Qwen2ForSequenceClassification(cfg)
    rm.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    critic = load_critic(str(tmp_path / "rm"), "float32")
    assert torch.equal(critic.score.weight, rm.score.weight)
    assert values(critic, tb).abs().max() > 0


def _ppo_setup(tmp_path, *overrides):
    model, tok = build_model(seed=0)
    save_hf_dir(tmp_path / "policy", model.state_dict(), model.config, tok)
    cfg = load_config(None, ["algorithm.name=ppo", "trainer.lr=1e-2", "critic.lr=1e-2",
                             "trainer.micro_batch_size=4", *overrides])
    steps = cfg.algorithm.epochs * cfg.algorithm.mini_batches
    policy = PolicyTrainer(model, cfg.trainer, steps, 1, torch.device("cpu"))
    critic_model = load_critic(str(tmp_path / "policy"), "float32")
    critic_cfg = dataclasses.replace(cfg.trainer, lr=cfg.critic.lr)
    critic = PolicyTrainer(critic_model, critic_cfg, steps, 1, torch.device("cpu"),
                           forward=lambda m, mb: (values(m, mb), None), name="critic")
    return cfg, tok, policy, critic


def test_ppo_epochs_and_mini_batches_take_one_optimizer_step_each(tmp_path):
    cfg, tok, policy, critic = _ppo_setup(tmp_path, "algorithm.epochs=2",
                                          "algorithm.mini_batches=3")
    stats = policy_step(policy, make_batch(3, 4, seed=2), cfg, tok.pad_token_id, critic=critic)
    assert policy.sched.last_epoch == 6 and critic.sched.last_epoch == 6
    assert stats["value_loss"] > 0 and stats["n_seqs"] == 12


def test_ppo_critic_fits_the_returns_of_a_fixed_batch(tmp_path):
    # lambda = 1 and no value clipping: the targets are the fixed Monte-Carlo returns
    cfg, tok, policy, critic = _ppo_setup(tmp_path, "trainer.lr=1e-9", "algorithm.lam=1.0",
                                          "critic.lr=2e-3", "critic.value_clip=0")
    batch = make_batch(2, 4, seed=3)
    first = policy_step(policy, batch, cfg, tok.pad_token_id, critic=critic)
    errs = [first["value_err_sum"]]
    for _ in range(15):
        errs.append(policy_step(policy, batch, cfg, tok.pad_token_id,
                                critic=critic)["value_err_sum"])
    assert errs[-1] < 0.2 * errs[0]


def test_kl_reward_penalty_shifts_outcome_advantages_by_the_kl_to_go(tmp_path):
    base, tok = build_model(seed=0)
    batch = make_batch(2, 4, seed=7)
    reference = copy.deepcopy(base).eval()

    def run(*overrides, ref=None):
        model = copy.deepcopy(base)
        cfg = load_config(None, ["trainer.lr=1e-2", *overrides])
        t = PolicyTrainer(model, cfg.trainer, 1, 1, torch.device("cpu"))
        return policy_step(t, batch, cfg, tok.pad_token_id, reference=ref)

    plain = run()
    zero = run("algorithm.kl_coef=1e-12", "algorithm.kl_mode=reward",
               "algorithm.kl_estimator=k1", ref=reference)
    shaped = run("algorithm.kl_coef=0.5", "algorithm.kl_mode=reward",
                 "algorithm.kl_estimator=k1", ref=reference)
    assert zero["loss"] == pytest.approx(plain["loss"], abs=1e-6)
    assert zero["kl_ref"] == pytest.approx(shaped["kl_ref"])  # the KL is measured either way
    assert abs(shaped["loss"] - plain["loss"]) > 1e-3
