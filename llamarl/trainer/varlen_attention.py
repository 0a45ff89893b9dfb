"""Attention for packed rows without flash-attn: scaled-dot-product attention sequence by
sequence.

A packed micro-batch is one row [1, L] of whole sequences laid end to end, their position ids
restarting at 0 for each (trainer/policy.py: TokenBatch.pack). Hugging Face's sdpa would keep
attention inside each sequence with an L x L block-diagonal mask, computing the whole square: at
L = 2048 on the 24M bench model that made the packed update slower than the padded one.
Here each sequence [a, b) of the row attends causally to itself only, one
`scaled_dot_product_attention(is_causal=True)` per sequence, so the work is the sum of the
sequences' own squares. On a GPU the whole row goes to one call of torch's flash-attention
varlen kernel instead (`torch.nn.attention.varlen.varlen_attn`, where it takes a `scale`; for
fp16/bf16 models: float32 keeps the per-sequence loop).
The boundaries come from TokenBatch.pack: where the varlen kernel runs, as an int32 tensor
already on the device (`llamarl_cu_seqlens`), elsewhere as a CPU tensor (`llamarl_bounds`,
for the loop), so neither path waits on the device; without them they are read off the
position ids. The CUDA path reads no Python value off them, so with trainer.compile it is
traced into each decoder block's graph. (A CPU tensor never reaches a GPU model's attention
as one: FSDP2's root moves every tensor argument to the GPU, and reading it there in every
layer made the host wait for the device 24 times per forward of a 24-layer model.)

Registered with Hugging Face as `llamarl_sdpa`; `load_policy`/`load_critic` use it for
`model.attn_implementation: sdpa`. Anything that is not a packed row (a padded batch with its
attention mask, a single sequence) goes to Hugging Face's own sdpa unchanged, with the same mask,
so padded results are bit for bit those of `sdpa`; except that on the CPU a masked call on
grouped key/value heads passes the groups to torch's kernel (`enable_gqa`) instead of repeating
them: the same outputs, the key/value gradients summed in another order; and that on the CPU
a bfloat16/float16 model's attention computes in float32 (torch's CPU kernels are several
times slower in half precision: bench/cpu_half_attention.py), its output cast back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "llamarl_sdpa"


def _sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                  **kwargs):
    if (query.device.type == "cpu" and query.dtype in HALF and CPU_HALF_IN_FLOAT32
            and kwargs.get("position_bias") is None):  # (a half bias would meet float32)
        # torch's CPU attention kernels are slow in bfloat16/float16 (the flash kernel's
        # backward on the tiny recipes' masked rows: 4x float32's), and float32 is the more
        # exact: the attention computes in float32, the rest of the model stays in half
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.float()
        out, weights = _attention(module, query.float(), key.float(), value.float(),
                                  attention_mask, dropout, scaling, **kwargs)
        return out.to(query.dtype), weights
    return _attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


# Half-precision attention on the CPU computes in float32 (False: in the model's dtype, for
# bench/cpu_half_attention.py's side-by-side comparison).
CPU_HALF_IN_FLOAT32 = True
HALF = (torch.bfloat16, torch.float16)


def _attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    pos = kwargs.get("position_ids")
    given = kwargs.pop("llamarl_bounds", None)  # [S + 1] on the CPU, from TokenBatch.pack
    # the same boundaries, int32 on the device: passed only where the varlen kernel runs
    cu = kwargs.pop("llamarl_cu_seqlens", None)
    longest = kwargs.pop("llamarl_max_seqlen", None)  # a Python int, with `cu`
    packed = pos is not None or given is not None or cu is not None
    if _cpu_masked_gqa(module, query, attention_mask, kwargs):
        # Hugging Face repeats the key/value heads whenever a mask is given; torch's CPU
        # kernel takes the grouped heads with the mask itself: the same output, a fifth less
        # time for the attention of the tiny recipes' update (bench/micro_batch_order.py)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                             dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is not None or not packed or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    p = dropout if module.training else 0.0
    if cu is not None and p == 0.0 and TRACE_VARLEN and _flash_fits(query):
        return _varlen_cuda(query, key, value, cu, scaling, longest), None
    out = _packed_attention(query, key, value, given, cu, pos, scaling, p)
    if out is None:  # one sequence (or not our packing): plain causal
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout,
                                      scaling=scaling, **kwargs)
    return out, None


def _cpu_masked_gqa(module, query: torch.Tensor, mask: torch.Tensor | None, kwargs) -> bool:
    """A CPU call with a 4-D mask (padded rows, shared-prompt trees) on grouped key/value
    heads, which Hugging Face's sdpa would repeat: torch's CPU flash kernel takes the groups
    and the mask as they are. (GPU kernels with a mask fall back to the math path under
    enable_gqa, so there Hugging Face's repeat stays.)"""
    return (mask is not None and mask.dim() == 4 and query.device.type == "cpu"
            and getattr(module, "num_key_value_groups", 1) > 1
            and kwargs.get("position_bias") is None and not kwargs.get("output_attentions"))


# The CUDA varlen path reads no Python value off the boundaries (they reach the kernel as a
# device tensor, and their longest sequence as an int that the compiled block takes as a
# symbolic input), so torch.compile traces it into the decoder block's graph: no graph break
# in the middle of every block (each break split a block into two compiled regions, with the
# guards and launches of both, forward and backward). False: the CUDA kernel is called from
# the untraced loop below instead.
TRACE_VARLEN = True


# Never compiled (trainer.compile): it reads the boundaries as Python ints, and traced, the
# guards on their count recompiled the block for each new number of sequences in a row.
@torch.compiler.disable
def _packed_attention(query, key, value, given, cu, pos, scaling, p):
    """query [1, H, L, D], key/value [1, H_kv, L, D] of a packed row -> [1, L, H, D], or None
    when the row holds one sequence. given: the sequence boundaries [S + 1] on the CPU; cu:
    the same as int32 on the device (or None)."""
    if given is not None:
        bounds = given.tolist()
    else:  # position ids restart at each sequence (reads the device: a sync per layer)
        bounds = torch.nonzero(pos[0] == 0).flatten().tolist() + [query.shape[2]]
    if len(bounds) <= 2 or bounds[0] != 0:
        return None
    if p == 0.0 and _flash_fits(query) and varlen_available(query.device):
        if cu is None or cu.device != query.device:
            cu = torch.tensor(bounds, dtype=torch.int32).to(query.device)
        return _varlen_cuda(query, key, value, cu, scaling,
                            max(b - a for a, b in zip(bounds, bounds[1:])))
    gqa = query.shape[1] != key.shape[1]
    out = torch.cat([F.scaled_dot_product_attention(
        query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=p, is_causal=True,
        scale=scaling, enable_gqa=gqa) for a, b in zip(bounds, bounds[1:])], dim=2)
    return out.transpose(1, 2).contiguous()  # [1, L, H, D], as HF's sdpa returns


_VARLEN: list = []  # [(varlen_attn, its causal keyword arguments)] once looked up, or [None]
_CAPABLE: dict = {}  # device index -> compute capability >= 8


def _varlen_kernel():
    """(torch.nn.attention.varlen.varlen_attn, {causal keyword}) when this torch has it with a
    `scale` argument (torch 2.9's has neither `scale` nor GQA), else None. Causal is
    `window_size=(-1, 0)` in newer torch, `is_causal=True` in older."""
    if not _VARLEN:
        import inspect

        try:
            from torch.nn.attention.varlen import varlen_attn
            params = inspect.signature(varlen_attn).parameters
        except (ImportError, ValueError, TypeError):
            params = {}
        if "scale" in params and ("window_size" in params or "is_causal" in params):
            causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
            _VARLEN.append((varlen_attn, causal))
        else:
            _VARLEN.append(None)
    return _VARLEN[0]


def varlen_available(device: torch.device) -> bool:
    """Whether torch's flash-attention varlen kernel runs on `device`: CUDA, compute
    capability >= 8, a torch whose varlen_attn takes a scale. Looked up once per device,
    outside any compiled region (TokenBatch inputs are built with it)."""
    if device.type != "cuda" or _varlen_kernel() is None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 8
    return _CAPABLE[index]


def _flash_fits(query) -> bool:
    """Flash attention's limits on the tensors: CUDA, fp16/bf16, head_dim <= 256 (a float32
    model, the default model.dtype, takes the per-sequence loop)."""
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and query.shape[-1] <= 256)


# Whether the varlen kernel is told the longest sequence of the row (PackedRows.longest) or,
# as before, the row's length L (False: for the bench's side-by-side comparison).
PASS_LONGEST = True


def _varlen_cuda(query, key, value, cu: torch.Tensor, scaling,
                 longest: int | None = None) -> torch.Tensor:
    """All sequences of the packed row in one flash-attention call: query [1, H, L, D],
    key/value [1, H_kv, L, D] -> [1, L, H, D], the sequence boundaries `cu` [S + 1] (int32,
    on the device), `longest` the longest sequence's length (None: L).

    Grouped KV heads go to the kernel as they are: flash attention reads each KV head for its
    H / H_kv query heads (repeating them cost two copies of K and V per layer and a reduction
    of their gradients). The longest-sequence bound sizes the kernel's grid: ceil(bound / 128)
    query blocks for each sequence and head, forward and backward. With the row's length L
    as the bound, a row of S sequences launched S times the blocks it needs (those past a
    sequence's end return at once, but are still scheduled: 16 sequences of 1024 tokens in a
    16384-token row, 15 of 16 blocks empty). The true longest is a Python int computed on the
    host when the row is packed; under torch.compile (dynamic shapes) it is a symbolic int of
    the compiled block, not a constant guarded on."""
    varlen_attn, causal = _VARLEN[0]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [L, H(_kv), D]
    bound = longest if longest is not None and PASS_LONGEST else q.shape[0]
    out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, bound, bound,
                      scale=scaling, **causal)
    return out[None]


def _mask(*args, attention_mask=None, **kwargs):
    """No L x L mask for a packed row (no 2-D attention mask): the attention splits it by
    position ids; otherwise sdpa's own mask."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Register the attention with Hugging Face (idempotent); its name for from_pretrained."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, _sdpa_forward)
    AttentionMaskInterface.register(NAME, _mask)
    return NAME


def implementation(name: str) -> str:
    """The implementation to load for `model.attn_implementation` = name."""
    return register() if name == "sdpa" else name
