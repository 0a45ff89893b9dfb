"""service/losses.py: Tinker's losses, by hand-computed values (per-token sums, not means)
and their gradients with respect to the target logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from llamarl.service.losses import LOSSES, check_inputs, check_loss


def _lp(*values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def _t(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_cross_entropy_is_the_weighted_sum_of_negative_logprobs():
    lp = _lp(-1.0, -2.0, -3.0)
    loss = LOSSES["cross_entropy"][0](lp, {"weights": _t(0.0, 1.0, 0.5)}, {})
    assert loss.item() == pytest.approx(2.0 + 1.5)  # a sum: not divided by the weights' 1.5
    loss.backward()
    assert lp.grad.tolist() == [0.0, -1.0, -0.5]


def test_importance_sampling_weights_the_advantage_by_the_ratio():
    lp = _lp(math.log(0.5), math.log(0.2))
    q, adv = _t(math.log(0.25), math.log(0.2)), _t(1.0, -2.0)
    loss = LOSSES["importance_sampling"][0](lp, {"logprobs": q, "advantages": adv}, {})
    assert loss.item() == pytest.approx(-(2.0 * 1.0 + 1.0 * -2.0))  # ratios 2 and 1
    loss.backward()  # d/dlp of -r A = -r A
    assert lp.grad.tolist() == pytest.approx([-2.0, 2.0])


def test_ppo_takes_the_pessimistic_of_the_clipped_and_unclipped_terms():
    # ratios 2.0 (A=+1: clipped to 1.2), 0.5 (A=-1: clipped to 0.8 -> min(-0.5, -0.8) = -0.8),
    # 1.0 (A=+3: inside)
    lp = _lp(math.log(0.4), math.log(0.1), math.log(0.3))
    q, adv = _t(math.log(0.2), math.log(0.2), math.log(0.3)), _t(1.0, -1.0, 3.0)
    loss = LOSSES["ppo"][0](lp, {"logprobs": q, "advantages": adv}, {})
    assert loss.item() == pytest.approx(-(1.2 - 0.8 + 3.0))
    loss.backward()  # clipped terms have no gradient; the inside one: -r A = -3
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, -3.0])
    wide = LOSSES["ppo"][0](lp, {"logprobs": q, "advantages": adv},
                            {"clip_low_threshold": 0.1, "clip_high_threshold": 10.0})
    assert wide.item() == pytest.approx(-(2.0 - 0.5 + 3.0))


def test_cispo_keeps_the_gradient_of_clipped_tokens_scaled_by_the_clipped_ratio():
    lp = _lp(math.log(0.4), math.log(0.3))
    q, adv = _t(math.log(0.2), math.log(0.3)), _t(1.0, 2.0)
    loss = LOSSES["cispo"][0](lp, {"logprobs": q, "advantages": adv}, {})
    assert loss.item() == pytest.approx(-(1.2 * math.log(0.4) * 1.0 + 1.0 * math.log(0.3) * 2))
    loss.backward()  # sg(clip(r)) A: 1.2 for the clipped token, not 0
    assert lp.grad.tolist() == pytest.approx([-1.2, -2.0])


def test_dro_penalises_the_squared_log_ratio():
    lp = _lp(-1.0, -2.0)
    q, adv = _t(-1.5, -2.0), _t(2.0, 1.0)
    loss = LOSSES["dro"][0](lp, {"logprobs": q, "advantages": adv}, {"beta": 0.4})
    assert loss.item() == pytest.approx(-((-2.0 - 0.5 * 0.4 * 0.25) + (-2.0)))
    loss.backward()  # -(A - beta (lp - q))
    assert lp.grad.tolist() == pytest.approx([-(2.0 - 0.4 * 0.5), -1.0])


def test_gspo_gives_every_token_the_sequence_ratio_and_its_own_gradient():
    # token log-ratios 0.1 and 0.3 (mean 0.2) over the marked tokens; the third is unmarked
    lp = _lp(-1.0, -1.0, -1.0)
    q = _t(-1.1, -1.3, -5.0)
    adv = _t(1.0, 1.0, 1.0)
    inputs = {"logprobs": q, "advantages": adv, "sequence_ratio_mask": _t(1, 1, 0)}
    s = math.exp(0.2)  # 1.2214 > 1.2: clipped for A > 0
    loss = LOSSES["gspo"][0](lp, inputs, {"clip_high_threshold": 1.5})
    assert loss.item() == pytest.approx(-3 * s)
    loss.backward()  # d/dlp_i of s_i = s: every token, marked or not
    assert lp.grad.tolist() == pytest.approx([-s, -s, -s])
    clipped = LOSSES["gspo"][0](lp, inputs, {})
    assert clipped.item() == pytest.approx(-3 * 1.2)


def test_bad_losses_and_inputs_are_named():
    with pytest.raises(ValueError, match="'dpo' is not one"):
        check_loss("dpo", None)
    with pytest.raises(ValueError, match="'beta' is not read by ppo"):
        check_loss("ppo", {"beta": 0.1})
    with pytest.raises(ValueError, match="has no 'advantages'"):
        check_inputs("ppo", 3, {"target_tokens": _t(1, 2, 3), "logprobs": _t(0, 0, 0)}, 0)
    with pytest.raises(ValueError, match=r"data\[2\].*'weights'.*shape \[2\].*give \[3\]"):
        check_inputs("cross_entropy", 3, {"target_tokens": _t(1, 2, 3), "weights": _t(1, 1)}, 2)
