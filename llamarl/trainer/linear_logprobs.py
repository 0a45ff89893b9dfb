"""Logprobs of the sampled tokens (and the entropy) straight from the final hidden states,
through the LM head chunk by chunk, with a hand-written backward: no float32 [N, V] tensor is
ever whole, and no autograd graph is kept over the vocabulary. (Small half-precision logits
are kept from forward to backward instead of recomputed: KEEP_LOGITS_MIB.)

For N positions with hidden states h [N, H], the head's weight W [V, H] (and bias b [V]),
targets y [N] and temperature tau:

    z = (h W^T + b) / tau                       [N, V], float32, one chunk of rows at a time
    log p = z - lse,  lse_n = log sum_v exp z_nv
    logp_n = log p_{n, y_n}                     (the sampled token's logprob)
    H_n = -sum_v p_nv log p_nv                  (the entropy)

Backward, recomputing each chunk's logits from h and W (as activation checkpointing would,
without autograd's bookkeeping: a gather's backward alone scattered into a zero [n, V] float32
tensor per chunk, which made packed micro-batches on an H100 slower than padded ones):

    d logp_n / d z_nv = [v = y_n] - p_nv
    d H_n / d z_nv    = -p_nv (log p_nv + H_n)
    g_z = (g_logp [v = y] - g_logp p + g_H dH/dz) / tau
    dh = g_z W,  dW = g_z^T h,  db = sum_n g_z      (g_z cast to the head's dtype, as autograd
                                                    casts the gradient of logits.float())

The values equal log_softmax(...).gather(...) and -(p log p).sum() to float rounding (tested,
|d| <= 1e-5 in float32, gradients too). The caller (policy.token_logprobs) runs this inside
the model's forward, where FSDP2 has the head's weight unsharded, so FSDP2 reduces dW as usual.
"""

from __future__ import annotations

import torch


def _chunk_forward(logits: torch.Tensor, y: torch.Tensor, tau: float):
    """lse, logp, entropy [n] of one chunk's logits [n, V] (the head's dtype)."""
    z = logits.float()
    if tau != 1.0:
        z = z / tau
    lse = torch.logsumexp(z, -1)
    logp_all = z.sub_(lse[:, None])  # log p, in z's memory
    logp = logp_all.gather(-1, y[:, None]).squeeze(-1)
    return lse, logp, -(torch.exp(logp_all) * logp_all).sum(-1)


def _chunk_grad(logits: torch.Tensor, y: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor,
                g_logp: torch.Tensor, g_ent: torch.Tensor | None, tau: float) -> torch.Tensor:
    """d loss / d logits [n, V] in the logits' dtype, for the upstream gradients g_logp and
    g_ent (None: the entropy has no gradient) of one chunk."""
    z = logits.float()
    if tau != 1.0:
        z = z / tau
    logp_all = z.sub_(lse[:, None])
    gz = torch.exp(logp_all)  # p
    if g_ent is not None:  # g_H dH/dz = -g_H p (log p + H), H = -E_p[log p]
        logp_all += ent[:, None]
        logp_all *= gz
        logp_all *= -g_ent[:, None]
    gz.mul_(-g_logp[:, None])  # -g p, in p's memory
    gz.scatter_add_(-1, y[:, None], g_logp[:, None])
    if g_ent is not None:
        gz += logp_all
    if tau != 1.0:
        gz /= tau
    return gz.to(logits.dtype)


def _chunk_forward_fusable(logits: torch.Tensor, y: torch.Tensor, tau: float):
    """_chunk_forward written for torch.compile: the same lse, logp, entropy [n] from row
    reductions only, so inductor reads the [n, V] logits without writing any [n, V]
    intermediate (the in-place version above materialised log p in float32 when compiled):

        m = max_v z,  s = sum_v exp(z - m),  lse = m + log s
        H = lse - E_p[z] = log s - sum_v exp(z - m) (z - m) / s
        logp_y = z_y - lse   (z_y gathered from the logits themselves)"""
    z = logits.float()
    if tau != 1.0:
        z = z / tau
    m = z.amax(-1, keepdim=True)
    e = torch.exp(z - m)
    s = e.sum(-1)
    lse = m.squeeze(-1) + torch.log(s)
    ent = torch.log(s) - (e * (z - m)).sum(-1) / s
    zy = logits.gather(-1, y[:, None]).squeeze(-1).float()
    if tau != 1.0:
        zy = zy / tau
    return lse, zy - lse, ent


def _chunk_grad_fusable(logits: torch.Tensor, y: torch.Tensor, lse: torch.Tensor,
                        ent: torch.Tensor, g_logp: torch.Tensor, g_ent: torch.Tensor | None,
                        tau: float) -> torch.Tensor:
    """_chunk_grad written for torch.compile: one elementwise expression (the one-hot of the
    targets as a comparison with the column index, not a scatter into a written tensor), so
    inductor makes it one pass that reads the logits and writes the gradient:

        g_z = ([v = y] g_logp - p (g_logp + g_H (log p + H))) / tau"""
    z = logits.float()
    if tau != 1.0:
        z = z / tau
    logp_all = z - lse[:, None]
    p = torch.exp(logp_all)
    coef = g_logp[:, None]
    if g_ent is not None:
        coef = coef + g_ent[:, None] * (logp_all + ent[:, None])
    cols = torch.arange(logits.shape[-1], device=logits.device)
    gz = torch.where(cols[None, :] == y[:, None], g_logp[:, None], 0.0) - p * coef
    if tau != 1.0:
        gz = gz / tau
    return gz.to(logits.dtype)


# The two elementwise passes over a chunk's [n, V] logits. Eager: the in-place versions (the
# least memory). Compiled by use_compiled(True) (trainer.compile): the fusable versions, which
# inductor turns into row reductions and one elementwise pass that each read the chunk's
# logits once. (Compiling the in-place versions wrote float32 [n, V] intermediates: on an
# H200 the head's elementwise work took 98 ms of a 0.87 s update of the 0.5B model.)
_forward_fn, _grad_fn = _chunk_forward, _chunk_grad


def use_compiled(on: bool) -> None:
    global _forward_fn, _grad_fn
    if on and _forward_fn is not _chunk_forward:
        return  # compiled already (each model's apply_fsdp asks again)
    if on:
        _forward_fn = torch.compile(FORWARD_FOR_COMPILE, dynamic=True)
        _grad_fn = torch.compile(GRAD_FOR_COMPILE, dynamic=True)
    else:
        _forward_fn, _grad_fn = _chunk_forward, _chunk_grad


# What use_compiled compiles (bench/trainer_throughput.py --unfused-head sets the in-place
# versions, to measure the difference).
FORWARD_FOR_COMPILE, GRAD_FOR_COMPILE = _chunk_forward_fusable, _chunk_grad_fusable


class LinearLogprobs(torch.autograd.Function):
    """(h [N, H], W [V, H], b [V] or None, y [N] long, tau, rows per chunk, entropy has a
    gradient, keep the chunks' logits for backward) -> (logp [N], entropy [N]), both
    float32."""

    @staticmethod
    def forward(ctx, h, w, b, y, tau: float, rows: int, entropy_grad: bool,
                keep_logits: bool = False):
        n = h.shape[0]
        logp, ent, lse = (torch.empty(n, dtype=torch.float32, device=h.device)
                          for _ in range(3))
        kept = []
        for a in range(0, n, rows):
            logits = torch.nn.functional.linear(h[a:a + rows], w, b)
            lse[a:a + rows], logp[a:a + rows], ent[a:a + rows] = _forward_fn(
                logits, y[a:a + rows], tau)
            if keep_logits:  # (_forward_fn reads them without writing into them)
                kept.append(logits)
        ctx.save_for_backward(h, w, b, y, lse, ent, *kept)
        ctx.tau, ctx.rows, ctx.entropy_grad = tau, rows, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable  # (no double backward through it)
    def backward(ctx, g_logp, g_ent):
        h, w, b, y, lse, ent, *kept = ctx.saved_tensors
        tau, rows = ctx.tau, ctx.rows
        n = h.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dh = torch.empty_like(h) if need_h else None
        # dW accumulates chunk by chunk in the weight's dtype with one addmm each (beta = 1),
        # as autograd would sum per-chunk gradients; a float32 buffer plus a cast per chunk
        # moved three [V, H] tensors through memory per chunk (most of the head's time)
        dw = torch.zeros_like(w) if need_w else None
        db = (torch.zeros(w.shape[0], dtype=torch.float32, device=w.device)
              if need_b and b is not None else None)
        g_logp = torch.zeros(n, device=h.device) if g_logp is None else g_logp.float()
        g_ent = g_ent.float() if ctx.entropy_grad and g_ent is not None else None
        for i, a in enumerate(range(0, n, rows)):
            hs = h[a:a + rows]
            logits = kept[i] if kept else torch.nn.functional.linear(hs, w, b)
            gz = _grad_fn(logits, y[a:a + rows],
                          lse[a:a + rows], ent[a:a + rows], g_logp[a:a + rows],
                          None if g_ent is None else g_ent[a:a + rows], tau)
            if need_h:
                dh[a:a + rows] = gz @ w
            if need_w:
                dw.addmm_(gz.t(), hs)
            if db is not None:
                db += gz.float().sum(0)
        return dh, dw, None if db is None else db.to(b.dtype), None, None, None, None, None


# Up to this many MiB of a micro-batch's half-precision logits (every chunk together) are
# kept from forward to backward instead of recomputed there: one [N, H] x [H, V] product fewer
# per micro-batch, the same values (the recomputed product is the same call on the same
# inputs). SmolLM2's 49k vocabulary over a micro-batch's ~740 scored positions is 72 MiB in
# bfloat16 (docs/measured.md has the time saved). Half precision only: float32 logits are the
# softmax pass's own buffer (`.float()` returns them, `sub_` overwrites them). 0 on a GPU,
# where the product is cheap next to the memory it would hold.
KEEP_LOGITS_MIB = 256.0
KEEP_LOGITS_MIB_CUDA = 0.0


def linear_logprobs(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    targets: torch.Tensor, temperature: float, rows: int,
                    entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logp and entropy [..., ] of the positions of h [..., H] (targets [...]), `rows`
    positions per chunk of the vocabulary computation; see the module docstring and
    KEEP_LOGITS_MIB."""
    lead = targets.shape
    h2 = h.reshape(-1, h.shape[-1])
    budget = KEEP_LOGITS_MIB_CUDA if h.is_cuda else KEEP_LOGITS_MIB
    keep = (torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
            and weight.dtype in (torch.bfloat16, torch.float16)
            and h2.shape[0] * weight.shape[0] * weight.element_size() <= budget * 2**20)
    lp, ent = LinearLogprobs.apply(h2, weight, bias, targets.reshape(-1), float(temperature),
                                   max(1, int(rows)), bool(entropy_grad), keep)
    return lp.reshape(lead), ent.reshape(lead)
