"""The policy as the trainer sees it: a HF causal LM, token batches, and per-token logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_policy(path: str, dtype: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    model.config.use_cache = False
    return model


@dataclass
class TokenBatch:
    """B sequences (prompt + completion), right-padded to T tokens.

    input_ids, attention_mask: [B, T]. Position t of the [B, T-1] tensors scores token t+1:
    targets = input_ids[:, 1:], mask = 1 where token t+1 is a completion token, old_logp = the
    behaviour logprob of that token (0 elsewhere).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    old_logp: torch.Tensor

    def to(self, device: torch.device) -> TokenBatch:
        return TokenBatch(*(t.to(device) for t in (self.input_ids, self.attention_mask,
                                                    self.targets, self.mask, self.old_logp)))


def collate(seqs: list[tuple[list[int], list[int], list[float]]], pad_id: int) -> TokenBatch:
    """seqs: (prompt ids, completion ids, behaviour logprobs per completion token)."""
    T = max(len(p) + len(c) for p, c, _ in seqs)
    B = len(seqs)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T - 1), dtype=torch.float32)
    old = torch.zeros((B, T - 1), dtype=torch.float32)
    for i, (p, c, lp) in enumerate(seqs):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(p + c, dtype=torch.long)
        attn[i, :n] = 1
        mask[i, len(p) - 1:n - 1] = 1.0
        if lp:
            old[i, len(p) - 1:n - 1] = torch.tensor(lp, dtype=torch.float32)
    return TokenBatch(ids, attn, ids[:, 1:].clone(), mask, old)


def token_logprobs(model: torch.nn.Module, batch: TokenBatch, temperature: float,
                   entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / temperature) of each next token, [B, T-1] float32, and the entropy
    of that distribution at each position, H = -sum_v p_v log p_v, [B, T-1] (with a gradient
    only when `entropy_grad`, for an entropy bonus).

    The generator samples from the same temperature-scaled softmax (top_p = 1, no top_k), so
    the logprobs are directly comparable with the behaviour logprobs it returns.
    """
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp_all = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, batch.targets[..., None]).squeeze(-1), entropy
