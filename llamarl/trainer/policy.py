"""The policy as the trainer sees it: a HF causal LM, token batches, and per-token logprobs."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from llamarl.buffer.record import segment_ids, segment_positions
from llamarl.trainer import varlen_attention
from llamarl.trainer.device import tensor_to
from llamarl.trainer.shared_prompts import SharedPromptRows, share_prompts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_policy(path: str, dtype: str, attn_implementation: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPES[dtype],
        attn_implementation=varlen_attention.implementation(attn_implementation))
    model.config.use_cache = False
    return model


def shard_for_training(model: torch.nn.Module, mesh, trainer_cfg,
                       param_dtype: torch.dtype) -> torch.nn.Module:
    """FSDP2 for a model the RL update trains (the policy, PPO's critic), with the recipe's
    `trainer` options (parallel/fsdp.py); trainer.compile compiles the LM head's softmax
    passes too (trainer/linear_logprobs.py: process-wide, like the partitioner's budget)."""
    from llamarl.parallel.fsdp import apply_fsdp, trainer_options
    from llamarl.trainer import linear_logprobs

    apply_fsdp(model, mesh, param_dtype=param_dtype, **trainer_options(trainer_cfg))
    if trainer_cfg.compile:
        linear_logprobs.use_compiled(True)
    return model


def load_frozen(path: str, cfg, mesh, device: torch.device) -> torch.nn.Module:
    """A frozen causal LM (the reference policy, a distillation teacher): no gradients, eval
    mode, in model.dtype, FSDP2-sharded on the trainer `mesh` like the policy (None:
    unsharded, one process)."""
    from llamarl.parallel.fsdp import apply_fsdp

    model = load_policy(path, cfg.model.dtype, cfg.model.attn_implementation).to(device)
    model.requires_grad_(False)
    model.eval()
    if mesh is None:
        return model
    return apply_fsdp(model, mesh, param_dtype=DTYPES[cfg.model.dtype])


@dataclass
class PackedRows:
    """The sequences of a micro-batch laid end to end in one row of L tokens, for a forward
    without padding: input_ids and position_ids [1, L] (positions restart at 0 for each
    sequence, which is how the model keeps attention inside each one). Packed position
    src[k] scores the same token as padded position (dst_row[k], dst_col[k]), [S] each; the
    last position of each sequence (it would score the next sequence's first token) has
    none. bounds: [N + 1] int64 on the CPU for the N sequences, the start of each and L
    (cumulative lengths), for the attention's per-sequence loop on the host (reading the
    boundaries off the position ids on a GPU stalled every layer). cu_seqlens: the same
    boundaries as int32, moved with the micro-batch to the model's device, for the varlen
    attention kernel (built in every layer from `bounds`, the copy made the host wait for
    the device 24 times per forward of a 24-layer model). longest: the longest sequence's
    length, a Python int read from `bounds` on the host, the kernel's bound on a sequence's
    length (it sizes the kernel's grid)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    src: torch.Tensor
    dst_row: torch.Tensor
    dst_col: torch.Tensor
    bounds: torch.Tensor
    cu_seqlens: torch.Tensor
    longest: int

    def to(self, device: torch.device) -> PackedRows:
        return PackedRows(**{f.name: getattr(self, f.name) if f.name in ("bounds", "longest")
                             else to_device(getattr(self, f.name), device)
                             for f in fields(self)})


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

    packed: the same rows laid end to end (`pack()`), or None. When set, the model runs on
    the packed row and its per-token outputs are put back into the [B, T-1] layout, so the
    losses read the same tensors either way; only the forward skips the padding.

    prompt_lens, group_ids: [B] (from the rollout; None for token lists built in code), read
    by `share()`. shared: the rows that share a prompt laid out as one tree each
    (`share()`, trainer/shared_prompts.py), or None; like `packed`, only the forward changes.
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
    packed: PackedRows | None = None
    prompt_lens: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None
    shared: SharedPromptRows | None = None

    def to(self, device: torch.device) -> TokenBatch:
        return TokenBatch(**{f.name: None if getattr(self, f.name) is None
                             else to_device(getattr(self, f.name), device)
                             for f in fields(self)})

    def take(self, rows: torch.Tensor | list[int]) -> TokenBatch:
        """Rows `rows` (indices), trimmed to the longest of them: a micro-batch."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        width = max(int(self.attention_mask[rows].sum(1).max()), 2) if len(rows) else 2
        out = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if t is None or f.name in ("packed", "shared"):
                out[f.name] = None
            elif t.dim() == 1:
                out[f.name] = t[rows]
            else:  # [B, T] columns keep `width`, [B, T-1] ones `width - 1`
                out[f.name] = t[rows, :width - (t.shape[1] < self.input_ids.shape[1])]
        return TokenBatch(**out)

    def pack(self) -> TokenBatch:
        """This micro-batch with `packed` set: its sequences end to end in one row."""
        keep = self.attention_mask.bool()
        lens = keep.sum(1)
        total = int(lens.sum())
        pos = segment_positions(lens, total)
        scored = pos > 0  # token c of a sequence is scored at c - 1; its first never is
        bounds = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).long().cpu()
        packed = PackedRows(self.input_ids[keep][None], pos[None],
                            torch.nonzero(scored).squeeze(1) - 1,
                            segment_ids(lens, total)[scored], pos[scored] - 1,
                            bounds, bounds.int(), int(lens.max()) if len(lens) else 0)
        return replace(self, packed=packed)

    def share(self) -> TokenBatch:
        """This micro-batch with `shared` set: each prompt once for the rows that share it."""
        assert self.prompt_lens is not None and self.group_ids is not None, "no prompt lengths"
        return replace(self, shared=share_prompts(self.input_ids, self.attention_mask,
                                                  self.prompt_lens, self.group_ids))

    def computed_tokens(self) -> tuple[int, int]:
        """(real, computed) tokens of this micro-batch's forward: padding is computed but not
        real; a shared prompt is computed (and counted) once for its rows."""
        if self.packed is not None:
            return self.packed.input_ids.numel(), self.packed.input_ids.numel()
        if self.shared is not None:
            return self.shared.tokens, self.shared.input_ids.numel()
        return int(self.attention_mask.sum()), self.attention_mask.numel()

    def padding_share(self) -> float:
        """The share of the tokens a forward computes that are padding (0 when packed)."""
        if self.packed is not None:
            return 0.0
        if self.shared is not None:
            return 1.0 - self.shared.tokens / max(self.shared.input_ids.numel(), 1)
        return 1.0 - float(self.attention_mask.sum()) / max(self.attention_mask.numel(), 1)


def to_device(t, device: torch.device):
    """`t` (a tensor, a PackedRows or SharedPromptRows) on `device` (device.tensor_to)."""
    if isinstance(t, (PackedRows, SharedPromptRows)):
        return t.to(device)
    return tensor_to(t, device)


def model_inputs(batch: TokenBatch) -> dict[str, torch.Tensor]:
    """The keyword arguments of a HF model's forward for `batch`: the padded rows with their
    attention mask, or the packed row with its position ids and no mask (Hugging Face then
    keeps attention inside each sequence: the sequence boundaries are where the position ids
    restart; flash_attention_2 reads them as varlen boundaries, sdpa/eager/flex get a
    block-diagonal causal mask; a KV cache would hide the boundaries from it, hence
    use_cache=False). The sequence boundaries reach the attention (varlen_attention) through
    Hugging Face's attention keyword arguments: `llamarl_cu_seqlens` on the model's device
    where torch's varlen flash attention runs (with `llamarl_max_seqlen`, the longest
    sequence), `llamarl_bounds` (CPU) elsewhere. Shared prompts: the trees with their
    position ids and their [N, 1, L, L] mask, which Hugging Face hands to sdpa as it is."""
    if batch.shared is not None:  # a 4-D mask goes to the attention as it is
        t = batch.shared
        return {"input_ids": t.input_ids, "position_ids": t.position_ids,
                "attention_mask": t.attention_mask, "use_cache": False}
    if batch.packed is None:
        return {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    p = batch.packed
    out = {"input_ids": p.input_ids, "position_ids": p.position_ids, "use_cache": False}
    kernel = varlen_attention.varlen_available(p.cu_seqlens.device)
    if kernel:
        out["llamarl_cu_seqlens"] = p.cu_seqlens
        out["llamarl_max_seqlen"] = p.longest
    if not (kernel and varlen_attention.TRACE_VARLEN):
        # Only where the attention reads them on the host: FSDP2's root module moves every
        # tensor argument to its device, blocking (torch.distributed.utils._to_kwargs), so on
        # a GPU these arrive as a GPU tensor whose read waits for the device in every layer
        out["llamarl_bounds"] = p.bounds
    return out


def scored(batch: TokenBatch, x: torch.Tensor) -> torch.Tensor:
    """The model's per-position outputs [B', L', *] at the positions that score a next token,
    aligned with `scored_targets`: [B', L'-1, *] (padded or packed), or the shared-prompt
    layout's scored entries [1, S, *]."""
    return batch.shared.scored(x) if batch.shared is not None else x[:, :-1]


def scored_targets(batch: TokenBatch) -> torch.Tensor:
    """The token scored at each position of `scored`'s layout."""
    if batch.shared is not None:
        return batch.shared.targets
    return batch.targets if batch.packed is None else batch.packed.input_ids[:, 1:]


def to_padded(batch: TokenBatch, x: torch.Tensor) -> torch.Tensor:
    """Outputs in `scored`'s layout, [1, L-1] packed, [1, S] shared or [B, T-1] padded, in
    the padded layout [B, T-1] (0 where nothing is scored); differentiable."""
    if batch.packed is None and batch.shared is None:
        return x
    p = batch.packed if batch.packed is not None else batch.shared
    out = x.new_zeros(batch.mask.shape)
    out[p.dst_row, p.dst_col] = x[0, p.src] if batch.packed is not None else x[0]
    return out


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
    return TokenBatch(ids, attn, ids[:, 1:].clone(), mask, old,
                      prompt_lens=batch.prompt_lens.long(), group_ids=batch.group_ids.clone())


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


# The float32 vocabulary softmax runs in chunks of about this many MiB: the logits of a
# [B, T] micro-batch, their float32 log-softmax, its exp and their product would each be
# [B, T, V]; chunked (and recomputed chunk by chunk in backward), only one chunk's exist at a
# time. Micro-batches smaller than one chunk (the tiny model's) take the one-chunk path.
# On a GPU bigger chunks: each chunk is a few kernel launches and a rank-n update of the
# head's gradient, and an H100 update of the 0.5B model took 2.6 s with 64 MiB chunks (110
# positions of a 152k vocabulary) against 2.1 s with 1 GiB ones; with the compiled blocks and
# 16384-token micro-batches, 512 MiB chunks were as fast as 1 GiB ones (0.664 against 0.694 s,
# medians of alternating runs) and 0.75 GiB lighter at the update's peak, which lies in the
# head's backward; 256 MiB was slower (docs/measured.md).
LOGPROB_CHUNK_MIB = 64.0
LOGPROB_CHUNK_MIB_CUDA = 512.0


def _logprobs_of_chunk(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                       entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, targets[..., None]).squeeze(-1), entropy


def _plain_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The LM head if the model's logits are exactly its output (no soft-capping or logit
    scale applied after it, as Gemma 2 and Cohere do): only then may it be chunked."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    cfg = getattr(model, "config", None)
    if (not isinstance(head, torch.nn.Linear) or getattr(cfg, "final_logit_softcapping", None)
            or getattr(cfg, "logit_scale", None) or hasattr(model, "logit_scale")):
        return None
    return head


def _over_spans(fn, x: torch.Tensor, targets: torch.Tensor,
                span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fn(x chunk, targets chunk) -> (logprobs, entropy) over spans of `span` positions (all
    rows), each recomputed in backward (non-reentrant activation checkpointing),
    concatenated along the positions."""
    from torch.utils.checkpoint import checkpoint

    if span >= targets.shape[1]:
        return fn(x, targets)
    parts = []
    for k in range(0, targets.shape[1], span):
        xs, ts = x[:, k:k + span], targets[:, k:k + span]
        if torch.is_grad_enabled() and x.requires_grad:
            parts.append(checkpoint(fn, xs, ts, use_reentrant=False))
        else:
            parts.append(fn(xs, ts))
    return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)


def _logprobs_through_head(model: torch.nn.Module, head: torch.nn.Linear, batch: TokenBatch,
                           targets: torch.Tensor, span: int, temperature: float,
                           entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One model forward whose LM head, for this call, turns the final hidden states into
    (logprobs, entropy) `span` positions of every row at a time (linear_logprobs: a
    hand-written backward that recomputes each chunk's logits) instead of returning [B, T, V]
    logits: the head runs inside the model's forward, where FSDP2 has its (tied) weight
    unsharded and its gradient is reduced as usual, and no [B, T, V] tensor is ever whole,
    forward or backward."""
    from llamarl.trainer.linear_logprobs import linear_logprobs

    def head_forward(hidden: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> scored [.., 2]
        w, b = head.weight, head.bias  # read now: FSDP2's unsharded parameters
        lp, ent = linear_logprobs(scored(batch, hidden), w, b, targets, temperature,
                                  span * targets.shape[0], entropy_grad)
        return torch.stack([lp, ent], -1)

    before = head.__dict__.get("forward")
    head.forward = head_forward
    try:
        out = model(**model_inputs(batch)).logits
    finally:
        if before is None:
            del head.forward
        else:
            head.forward = before
    return out[..., 0], out[..., 1] if entropy_grad else out[..., 1].detach()


def token_logprobs(model: torch.nn.Module, batch: TokenBatch, temperature: float,
                   entropy_grad: bool = False,
                   chunk_mib: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / temperature) of each next token, [B, T-1] float32, and the entropy
    of that distribution at each position, H = -sum_v p_v log p_v, [B, T-1] (with a gradient
    only when `entropy_grad`, for an entropy bonus). 0 where nothing is scored when `batch`
    is packed (the model then runs on the packed row; see TokenBatch).

    The generator samples from the same temperature-scaled softmax (top_p = 1, no top_k), so
    the logprobs are directly comparable with the behaviour logprobs it returns.

    Memory: when the float32 [B, T, V] softmax is over `chunk_mib` MiB, the LM head itself
    runs in spans of positions of about that size (logits, float32 log-softmax, entropy and
    the gather of the targets), each recomputed in backward, so no [B, T, V] tensor (logits or
    their gradient) exists whole; values and gradients agree with the one-chunk computation
    to float rounding (|d| <= 1e-5, tested). A model whose logits are not its head's output
    (soft-capped, scaled) keeps whole logits and chunks only the softmax, bit for bit. 0 = one
    chunk; None = LOGPROB_CHUNK_MIB (LOGPROB_CHUNK_MIB_CUDA on a GPU).
    """
    if chunk_mib is None:
        cuda = batch.input_ids.is_cuda
        chunk_mib = LOGPROB_CHUNK_MIB_CUDA if cuda else LOGPROB_CHUNK_MIB
    targets = scored_targets(batch)
    B, T = targets.shape
    vocab = model.config.vocab_size
    span = T if chunk_mib <= 0 else max(1, int(chunk_mib * 2**20 / (4 * vocab)) // max(B, 1))
    head = _plain_head(model) if span < T else None
    if head is not None:
        lp, ent = _logprobs_through_head(model, head, batch, targets, span, temperature,
                                         entropy_grad)
    else:
        logits = scored(batch, model(**model_inputs(batch)).logits)
        lp, ent = _over_spans(
            lambda lg, t: _logprobs_of_chunk(lg, t, temperature, entropy_grad),
            logits, targets, min(span, T))
    return to_padded(batch, lp), to_padded(batch, ent)
