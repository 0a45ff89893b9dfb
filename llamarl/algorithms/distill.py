"""On-policy distillation (algorithm.name = on_policy_distill): a frozen teacher scores, token by
token, the completions the student (the policy being trained) sampled itself.

For sample i and each token y_t the policy sampled (its loss mask: in multi-turn episodes the
observations between turns are context and are not scored), with the student pi_theta as it
stands before this update (the weights the batch is trained from) and the teacher pi_T, both
at the sampling temperature:

    d_t = log pi_theta(y_t | y_<t) - log pi_T(y_t | y_<t)    [B, T]   the per-token reverse KL:
                                                                       E_{y_t ~ pi_theta}[d_t] =
                                                                       KL(pi_theta || pi_T) at t
    A_t = -distill_coef * d_t + reward_coef * A_i             [B, T]   the per-token advantage

A_i is algorithm.advantage (GRPO's by default) on the task reward, [B]; reward_coef = 0 (the
default) is distillation alone. A_t is a constant of the policy loss (stop-gradient), and each
token is credited with its own d_t only (no sum over the later tokens: a discount of 0), as in
the published method (Agarwal et al. 2024, "On-Policy Distillation of Language Models"; Lu and
Thinking Machines 2025, "On-Policy Distillation"). The policy loss (ppo_clip, or
algorithm.correction's) then raises log pi_theta(y_t) where the teacher gives the sampled
token more probability than the student, and lowers it where less; its importance ratio
pi_theta / mu against the behaviour policy mu that sampled the batch is the usual correction
for stale samples.

The run's metric kl_teacher is the mean of d_t over the sampled tokens of the global batch: an
estimate of the student's per-token reverse KL to the teacher.
"""

from __future__ import annotations

import torch


def distill_advantages(student_logp: torch.Tensor, teacher_logp: torch.Tensor,
                       mask: torch.Tensor, seq_advantages: torch.Tensor | None,
                       distill_coef: float, reward_coef: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """student_logp, teacher_logp, mask (1 on sampled tokens): [B, T]; seq_advantages: [B]
    (A_i of the task reward; read only when reward_coef != 0). Returns (A [B, T], d [B, T]),
    both 0 off the mask. With a teacher identical to the student, d and A are exactly 0."""
    mask = mask.float()
    d = (student_logp - teacher_logp) * mask
    adv = -distill_coef * d
    if reward_coef:
        assert seq_advantages is not None, "reward_coef needs the task reward's advantages"
        adv = adv + reward_coef * seq_advantages.float()[:, None] * mask
    return adv, d
