"""The policy as the trainer sees it: a HF causal LM, token batches, and per-token logprobs."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from llamarl.buffer.record import segment_ids, segment_positions

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_policy(path: str, dtype: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    model.config.use_cache = False
    return model


@dataclass
class TokenBatch:
    """B sequences, right-padded to T tokens.

    input_ids, attention_mask: [B, T]. Position t of the [B, T-1] tensors scores token t+1:
    targets = input_ids[:, 1:], mask = 1 where token t+1 was sampled by the policy (its loss
    mask), old_logp = the behaviour logprob of that token (0 elsewhere).

    The RL update attaches what its losses read, as fields rather than by micro-batch index:
    advantages [B] (one per sample) or [B, T-1] (per token), returns and old_values [B, T-1]
    (PPO's critic), ref_logp [B, T-1] (the frozen reference's logprobs, for a KL term); None
    where the algorithm has none (and on masked filler micro-batches).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None

    def to(self, device: torch.device) -> TokenBatch:
        return TokenBatch(**{f.name: None if getattr(self, f.name) is None
                             else getattr(self, f.name).to(device) for f in fields(self)})

    def take(self, rows: torch.Tensor | list[int]) -> TokenBatch:
        """Rows `rows` (indices), trimmed to the longest of them: a micro-batch."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        width = max(int(self.attention_mask[rows].sum(1).max()), 2) if len(rows) else 2
        out = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if t is None:
                out[f.name] = None
            elif t.dim() == 1:
                out[f.name] = t[rows]
            else:  # [B, T] columns keep `width`, [B, T-1] ones `width - 1`
                out[f.name] = t[rows, :width - (t.shape[1] < self.input_ids.shape[1])]
        return TokenBatch(**out)


def pad_rollouts(batch, pad_id: int) -> TokenBatch:
    """The padded tensors of a whole RolloutBatch, built once per rollout batch by index
    arithmetic on its flat columns (no per-row loop). T = the longest sample."""
    lens = batch.seq_lens.long()
    B, L = len(lens), len(batch.token_ids)
    T = max(int(lens.max()), 2) if B else 2
    row, col = segment_ids(lens, L), segment_positions(lens, L)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    ids[row, col] = batch.token_ids.long()
    attn = torch.zeros((B, T), dtype=torch.long)
    attn[row, col] = 1
    # token at column c is scored at position c - 1 (a sample's first token is never scored)
    scored = col > 0
    mask = torch.zeros((B, T - 1), dtype=torch.float32)
    mask[row[scored], col[scored] - 1] = batch.loss_mask[scored].float()
    old = torch.zeros((B, T - 1), dtype=torch.float32)
    old[row[scored], col[scored] - 1] = batch.logprobs[scored]  # 0 off the loss mask
    return TokenBatch(ids, attn, ids[:, 1:].clone(), mask, old)


def collate(seqs: list[tuple[list[int], list[int], list[float]]], pad_id: int) -> TokenBatch:
    """(prompt ids, completion ids, behaviour logprobs per completion token) lists -> a
    TokenBatch; for token lists built in code (the tiny model's warm start, tests). Rollouts
    take pad_rollouts."""
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


# The float32 vocabulary softmax runs in chunks of about this many MiB: the full [B, T, V]
# float32 log-softmax, its exp and their product would each be as large as the logits; chunked
# (and recomputed chunk by chunk in backward), only one chunk's exist at a time. Micro-batches
# smaller than one chunk (the tiny model's) take the one-chunk path unchanged.
LOGPROB_CHUNK_MIB = 256.0


def _logprobs_of_chunk(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                       entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, targets[..., None]).squeeze(-1), entropy


def token_logprobs(model: torch.nn.Module, batch: TokenBatch, temperature: float,
                   entropy_grad: bool = False,
                   chunk_mib: float = LOGPROB_CHUNK_MIB) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / temperature) of each next token, [B, T-1] float32, and the entropy
    of that distribution at each position, H = -sum_v p_v log p_v, [B, T-1] (with a gradient
    only when `entropy_grad`, for an entropy bonus).

    The generator samples from the same temperature-scaled softmax (top_p = 1, no top_k), so
    the logprobs are directly comparable with the behaviour logprobs it returns.

    Memory: the softmax over the vocabulary runs in chunks of about `chunk_mib` MiB of float32
    (whole rows x a span of positions), each recomputed in backward (activation
    checkpointing), so the float32 [B, T, V] tensors of an unchunked log-softmax never exist;
    every value and gradient is the same, bit for bit (0 = one chunk).
    """
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logits = logits[:, :-1]
    B, T = batch.targets.shape
    positions = int(chunk_mib * 2**20 / (4 * logits.shape[-1])) if chunk_mib > 0 else B * T
    step = max(1, positions // max(B, 1))
    if step >= T:
        return _logprobs_of_chunk(logits, batch.targets, temperature, entropy_grad)
    from torch.utils.checkpoint import checkpoint

    parts = []
    for lc, tc in zip(logits.split(step, dim=1), batch.targets.split(step, dim=1)):
        if torch.is_grad_enabled() and lc.requires_grad:
            parts.append(checkpoint(_logprobs_of_chunk, lc, tc, temperature, entropy_grad,
                                    use_reentrant=False))
        else:
            parts.append(_logprobs_of_chunk(lc, tc, temperature, entropy_grad))
    return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)
