"""service/tenants.py: LoRA tenants on one base. Each tenant's losses and weights equal
training it alone, bitwise; one forward_backward equals Tinker's definition computed directly
(the model's full log-softmax, the loss of service/losses.py); bad requests are refused
before any compute and leave the tenants as they were."""

from __future__ import annotations

import copy

import pytest
import torch

from llamarl.service.losses import LOSSES
from llamarl.service.tenants import AdamStep, Datum, LoraSpec, LoraTenants, micro_batches


@pytest.fixture(scope="module")
def base():
    from llamarl.tiny.model import build_model

    model, tok = build_model(seed=0)
    return model, tok


def _tenants(base, max_tenants=4, micro_batch_tokens=4096) -> LoraTenants:
    model, tok = base
    return LoraTenants(copy.deepcopy(model), max_tenants, 64, tok.pad_token_id,
                       micro_batch_tokens)


def _data(seed: int, n: int = 3, loss: str = "cross_entropy") -> list[Datum]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 5 + 3 * i
        seq = torch.randint(4, 30, (length + 1,), generator=g)
        inputs = {"target_tokens": seq[1:]}
        if loss == "cross_entropy":
            inputs["weights"] = (torch.arange(length) >= 2).float()
        else:
            inputs["logprobs"] = -torch.rand(length, generator=g) * 3
            inputs["advantages"] = torch.randn(length, generator=g)
        out.append(Datum(seq[:-1], inputs))
    return out


STEP = AdamStep(learning_rate=1e-2)


def _train(t: LoraTenants, name: str, seed: int, steps: int) -> list[float]:
    losses = []
    for s in range(steps):
        losses.append(t.forward(name, _data(seed + s), "cross_entropy", backward=True).loss)
        losses.append(t.forward(name, _data(seed + 100 + s, loss="importance_sampling"),
                                "importance_sampling", backward=True).loss)
        t.optim_step(name, STEP)
    return losses


def test_two_tenants_interleaved_equal_each_trained_alone_bitwise(base):
    alone = {}
    for name, seed in (("a", 1), ("b", 2)):
        t = _tenants(base)
        t.create(name, LoraSpec(rank=4, seed=seed))
        alone[name] = (_train(t, name, 10 * seed, 3), t.adapter_state(name))
    both = _tenants(base)
    both.create("a", LoraSpec(rank=4, seed=1))
    both.create("b", LoraSpec(rank=4, seed=2, train_mlp=False))  # other modules: no matter
    both.remove("b")
    both.create("b", LoraSpec(rank=4, seed=2))
    mixed = {"a": [], "b": []}
    for s in range(3):  # step by step, alternating, with b's forward_backward between a's
        for name, seed in (("a", 1), ("b", 2)):
            mixed[name].append(both.forward(name, _data(10 * seed + s), "cross_entropy",
                                            backward=True).loss)
        for name, seed in (("b", 2), ("a", 1)):
            mixed[name].append(both.forward(name, _data(10 * seed + 100 + s,
                                                        loss="importance_sampling"),
                                            "importance_sampling", backward=True).loss)
        both.optim_step("a", STEP)
        both.optim_step("b", STEP)
    for name in ("a", "b"):
        assert mixed[name] == alone[name][0]
        state = both.adapter_state(name)
        assert state.keys() == alone[name][1].keys()
        assert all(torch.equal(state[k], alone[name][1][k]) for k in state)
    assert not torch.equal(both.adapter_state("a")[next(iter(state))],
                           both.adapter_state("b")[next(iter(state))])


@pytest.mark.parametrize("loss_fn", sorted(LOSSES))
def test_forward_backward_equals_the_definition_computed_directly(base, loss_fn):
    """The loss and the adapter's gradient of one forward_backward, against the same model
    run datum by datum with its whole log-softmax (no padding, no chunking)."""
    t = _tenants(base)
    t.create("m", LoraSpec(rank=4, seed=3))
    with torch.no_grad():  # B = 0 at creation: move off it so that every term matters
        for p in t.get("m").params:
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
    data = _data(5, loss="cross_entropy" if loss_fn == "cross_entropy" else "ppo")
    got = t.forward("m", data, loss_fn, {}, backward=True)
    got_grads = [p.grad.clone() for p in t.get("m").params]
    for p in t.get("m").params:
        p.grad = None
    want = 0.0
    for d in data:
        logits = t.model(input_ids=d.tokens[None]).logits[0].float()
        lp = torch.log_softmax(logits, -1).gather(1, d.inputs["target_tokens"][:, None])[:, 0]
        want = want + LOSSES[loss_fn][0](lp, d.inputs, {})
    want.backward()
    assert got.loss == pytest.approx(want.item(), rel=1e-5, abs=1e-5)
    got_g = torch.cat([g.flatten() for g in got_grads])
    want_g = torch.cat([p.grad.flatten() for p in t.get("m").params])
    assert float(want_g.norm()) > 0
    # float32 rounding of other matmul shapes: ~1e-6 of the gradient's norm measured
    assert float((got_g - want_g).norm() / want_g.norm()) < 1e-5


def test_micro_batches_cut_in_order_by_padded_size():
    data = [Datum(torch.zeros(n, dtype=torch.long), {}) for n in (3, 5, 2, 9, 1, 1)]
    runs = micro_batches(data, 12)  # (2 x 6 = 12 fits; 3 x 6 does not; 9 + 1 alone)
    assert [[len(d.tokens) for d in r] for r in runs] == [[3, 5], [2], [9], [1, 1]]
    assert [d for r in runs for d in r] == data


def test_bad_requests_are_refused_and_change_nothing(base):
    t = _tenants(base, max_tenants=1)
    t.create("m", LoraSpec(rank=2, seed=0))
    before = t.adapter_state("m")
    d = _data(0)
    bad = [
        ([Datum(torch.tensor([1, 2, 999]), {"target_tokens": torch.tensor([1, 2, 3]),
                                           "weights": torch.ones(3)})], "outside the vocab"),
        ([Datum(torch.arange(65) % 20, {"target_tokens": torch.arange(65) % 20,
                                         "weights": torch.ones(65)})], "65 tokens, over"),
        ([Datum(d[0].tokens, {"target_tokens": d[0].inputs["target_tokens"],
                              "weights": torch.ones(2)})], "shape"),
        ([], "no data"),
    ]
    for data, message in bad:
        with pytest.raises(ValueError, match=message):
            t.forward("m", data, "cross_entropy", backward=True)
    with pytest.raises(ValueError, match="not one this server computes"):
        t.forward("m", d, "dpo", backward=True)
    with pytest.raises(KeyError, match="no model 'x'"):
        t.forward("x", d, "cross_entropy")
    with pytest.raises(ValueError, match="at most 1 LoRA models"):
        t.create("n", LoraSpec(rank=2, seed=0))
    assert all(p.grad is None for p in t.get("m").params)
    after = t.adapter_state("m")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_state_round_trip_with_and_without_the_optimizer(base):
    t = _tenants(base)
    t.create("m", LoraSpec(rank=4, seed=0))
    _train(t, "m", 0, 2)
    saved = t.state("m", with_optimizer=True)
    weights_only = t.state("m", with_optimizer=False)
    cont = _train(t, "m", 50, 2)
    for state, same in ((saved, True), (weights_only, False)):
        t.remove("m")
        t.create("m", LoraSpec(rank=4, seed=0))
        t.load_state("m", state, with_optimizer="optimizer" in state)
        again = _train(t, "m", 50, 2)
        assert again[0] == cont[0]  # the first forward sees the same weights either way
        assert (again == cont) is same  # Adam's moments restored or started afresh
    t.remove("m")
    t.create("m", LoraSpec(rank=8, seed=0))
    with pytest.raises(ValueError, match="another adapter shape"):
        t.load_state("m", saved, with_optimizer=True)
