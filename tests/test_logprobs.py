"""Chunked logprobs: the same values and gradients as the one-chunk softmax, position by
position (the float32 [B, T, V] tensors are never all alive at once)."""

from __future__ import annotations

import pytest
import torch

from llamarl.trainer.policy import TokenBatch, token_logprobs


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_logprobs_equal_the_unchunked_ones_with_gradients(entropy_grad):
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
    out = {}
    for chunk in (0, 0.4):  # one chunk; 0.4 MiB = 34 positions x 3 rows per chunk
        model.zero_grad()
        lp, ent = token_logprobs(model, batch, 0.7, entropy_grad, chunk_mib=chunk)
        loss = lp.sum() * 0.3 + (ent.sum() * 0.1 if entropy_grad else 0.0)
        loss.backward()
        out[chunk] = (lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()])
    (lp0, ent0, g0), (lp1, ent1, g1) = out[0], out[0.4]
    assert torch.equal(lp0, lp1) and torch.equal(ent0, ent1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert ent1.requires_grad is False or entropy_grad
