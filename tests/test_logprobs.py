"""Chunked logprobs: the LM head and the float32 softmax in spans of positions, recomputed in
backward, give the values and gradients of the one-chunk computation (|d| <= 1e-5 in
float32); a model whose logits are not its head's output chunks only the softmax, bit for
bit."""

from __future__ import annotations

import pytest
import torch

from llamarl.trainer.policy import TokenBatch, token_logprobs


def _model_and_batch():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=3000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256))
    B, T = 3, 200
    ids = torch.randint(0, 3000, (B, T))
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, 150:] = 0
    batch = TokenBatch(ids, attn, ids[:, 1:].clone(), torch.ones(B, T - 1),
                       torch.zeros(B, T - 1))
    return model, batch


def _run(model, batch, entropy_grad, chunk):
    model.zero_grad()
    lp, ent = token_logprobs(model, batch, 0.7, entropy_grad, chunk_mib=chunk)
    loss = lp.sum() * 0.3 + (ent.sum() * 0.1 if entropy_grad else 0.0)
    loss.backward()
    assert ent.requires_grad is False or entropy_grad
    return lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_head_equals_the_unchunked_logprobs_with_gradients(entropy_grad):
    model, batch = _model_and_batch()
    calls = []
    model.lm_head.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    lp0, ent0, g0 = _run(model, batch, entropy_grad, 0)  # one chunk: whole [B, T, V] logits
    assert calls == [(3, 200, 3000)]
    lp1, ent1, g1 = _run(model, batch, entropy_grad, 0.4)  # 34 positions x 3 rows per span
    assert calls[1] == (3, 199, 2), "the head returned logprobs and entropy, not logits"
    assert (lp0 - lp1).abs().max() <= 1e-5 and (ent0 - ent1).abs().max() <= 1e-5
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    assert "forward" not in model.lm_head.__dict__, "the head's own forward is back"


def test_a_head_with_soft_capping_chunks_only_the_softmax_bit_for_bit():
    model, batch = _model_and_batch()
    # Qwen2 ignores the key; llamarl must then assume logits != head output and keep them whole
    model.config.final_logit_softcapping = 30.0
    lp0, ent0, g0 = _run(model, batch, True, 0)
    lp1, ent1, g1 = _run(model, batch, True, 0.4)
    assert torch.equal(lp0, lp1) and torch.equal(ent0, ent1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_logprobs_backward_equals_autograd_of_the_whole_softmax(entropy_grad, bias):
    """The hand-written backward of the chunked head (rows that do not divide N, a bias, a
    temperature) against autograd through the whole [N, V] log-softmax."""
    from llamarl.trainer.linear_logprobs import linear_logprobs

    torch.manual_seed(1)
    N, H, V, tau = 37, 16, 500, 0.7
    h = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    b = torch.randn(V, dtype=torch.float64, requires_grad=True) if bias else None
    y = torch.randint(0, V, (N,))
    g_lp, g_ent = torch.randn(N, dtype=torch.float64), torch.randn(N, dtype=torch.float64)

    def grads(lp, ent):
        loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if entropy_grad else 0.0)
        params = [h, w] + ([b] if bias else [])
        return torch.autograd.grad(loss, params)

    logp_all = torch.log_softmax(torch.nn.functional.linear(h, w, b).float() / tau, -1)
    lp0 = logp_all.gather(-1, y[:, None]).squeeze(-1)
    ent0 = -(logp_all.exp() * logp_all).sum(-1)
    ref = grads(lp0.double(), ent0.double())
    lp1, ent1 = linear_logprobs(h, w, b, y, tau, rows=8, entropy_grad=entropy_grad)
    assert ent1.requires_grad == entropy_grad
    assert (lp0 - lp1).abs().max() <= 1e-5 and (ent0 - ent1).abs().max() <= 1e-5
    for a, c in zip(ref, grads(lp1.double(), ent1.double())):
        assert torch.allclose(a.float(), c.float(), rtol=1e-4, atol=1e-5), (a - c).abs().max()


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_kept_logits_give_the_recomputed_gradients_bit_for_bit(monkeypatch, entropy_grad):
    """A bfloat16 head under KEEP_LOGITS_MIB keeps its logits for backward; recomputing them
    (the budget at 0) gives the same logprobs, entropies and gradients, bit for bit."""
    from llamarl.trainer import linear_logprobs as head

    torch.manual_seed(2)
    h0 = torch.randn(300, 32, dtype=torch.bfloat16)
    w0 = torch.randn(2000, 32, dtype=torch.bfloat16)
    y = torch.randint(0, 2000, (300,))
    saved = []
    real_apply = head.LinearLogprobs.apply
    monkeypatch.setattr(head.LinearLogprobs, "apply",
                        lambda *a: saved.append(a[-1]) or real_apply(*a))

    def run(budget):
        monkeypatch.setattr(head, "KEEP_LOGITS_MIB", budget)
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        lp, ent = head.linear_logprobs(h, w, None, y, 1.0, 64, entropy_grad=entropy_grad)
        (lp.sum() + (0.3 * ent.sum() if entropy_grad else 0.0)).backward()
        return lp.detach(), ent.detach(), h.grad, w.grad

    kept, recomputed = run(256.0), run(0.0)
    assert saved == [True, False]  # each path taken once
    assert all(torch.equal(a, b) for a, b in zip(kept, recomputed))


def test_compiled_softmax_passes_equal_the_eager_ones():
    """trainer.compile compiles the head's two elementwise passes (linear_logprobs.use_compiled):
    same values and gradients, entropy gradient included."""
    from llamarl.trainer import linear_logprobs as head

    torch.manual_seed(0)
    h = torch.randn(300, 32, requires_grad=True)
    w = torch.randn(2000, 32, requires_grad=True)
    y = torch.randint(0, 2000, (300,))

    def run():
        lp, ent = head.linear_logprobs(h, w, None, y, 0.8, 64, entropy_grad=True)
        (lp.sum() + 0.3 * ent.sum()).backward()
        out = (lp.detach(), ent.detach(), h.grad.clone(), w.grad.clone())
        h.grad = w.grad = None
        return out

    eager = run()
    head.use_compiled(True)
    try:
        compiled = run()
    finally:
        head.use_compiled(False)
    for a, b in zip(eager, compiled):
        assert torch.allclose(a, b, rtol=1e-5, atol=2e-5), (a - b).abs().max()


@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_the_fusable_softmax_passes_equal_the_in_place_ones(tau, entropy_grad):
    """What trainer.compile compiles (linear_logprobs._chunk_*_fusable: row reductions and one
    elementwise expression) computes the in-place passes' lse, logprob, entropy and logits
    gradient (both compute in float32) to float32 rounding."""
    from llamarl.trainer import linear_logprobs as head

    torch.manual_seed(2)
    logits = torch.randn(23, 300, dtype=torch.float64) * 4
    y = torch.randint(0, 300, (23,))
    g_lp, g_ent = torch.randn(23), torch.randn(23)
    lse0, lp0, ent0 = head._chunk_forward(logits, y, tau)
    lse1, lp1, ent1 = head._chunk_forward_fusable(logits, y, tau)
    for a, b in ((lse0, lse1), (lp0, lp1), (ent0, ent1)):
        assert torch.allclose(a, b, rtol=1e-6, atol=2e-6), (a - b).abs().max()
    g = g_ent if entropy_grad else None
    gz0 = head._chunk_grad(logits, y, lse0, ent0, g_lp, g, tau)
    gz1 = head._chunk_grad_fusable(logits, y, lse0, ent0, g_lp, g, tau)
    assert torch.allclose(gz0, gz1, rtol=1e-5, atol=2e-6), (gz0 - gz1).abs().max()
