"""Does the weight sync fit the GPU memory a vLLM engine leaves free?

On a GPU, vLLM takes `gpu_memory_utilization` of the card for the model, its activations and
the KV cache, and leaves the rest: free = (1 - u) x total, less what other processes hold. The
weight sync's receiving end (parallel/weight_receiver.py) lives in that rest:

    receive buffers   every sender's shard of every tensor, in the wire dtype, kept for the
                      whole run (later syncs land there and are copied into the engine):
                      the model's bytes, B
    first sync        each tensor that arrives in pieces from several senders (FSDP2 shards
                      rows over T trainer ranks) is put together once, and kept until the
                      load is recorded: up to B more when T > 1

    need = B + (B if T > 1 else 0) + SYNC_MARGIN        (NCCL's own buffers, allocator slack)

Qwen2.5-7B in bf16 is B = 14.2 GiB: 28.4 GiB for T = 8, while u = 0.85 leaves 11.9 GiB of an
80 GB H100. The engine checks at start (worker_ext.llamarl_join_weight_sync), before it
allocates anything, and names the key and the value that fits; tests/test_gpu_memory.py runs
the same arithmetic over every GPU recipe from its model's config.json.
"""

from __future__ import annotations

import math

from llamarl.parallel.weight_plan import TensorMeta, itemsize

GIB = 1 << 30
SYNC_MARGIN = 1 * GIB  # NCCL's buffers and the allocator's slack beside the sync's tensors


def sync_need_bytes(metas_by_sender: list[list[TensorMeta]]) -> int:
    """GPU bytes one engine's weight sync holds at its peak (the first sync), from the
    senders' shard layouts: every piece's receive buffer, plus every tensor that comes in
    more than one piece, put together once."""
    buffers, pieces, full = 0, {}, {}
    for metas in metas_by_sender:
        for m in metas:
            size = m.numel * itemsize(m.dtype)
            buffers += size
            pieces[m.name] = pieces.get(m.name, 0) + 1
            full[m.name] = math.prod(m.shape) * itemsize(m.dtype)
    assembled = sum(full[name] for name, n in pieces.items() if n > 1)
    return buffers + assembled


def utilization_that_fits(need: int, free: int, total: int, utilization: float) -> float:
    """The largest gpu_memory_utilization (in hundredths) under which `need` + SYNC_MARGIN
    bytes stay free, given `free` bytes free under `utilization`."""
    short = need + SYNC_MARGIN - free
    return math.floor((utilization - short / total) * 100) / 100


def check_sync_fits(need: int, free: int, total: int, utilization: float,
                    senders: int, kv_cache_gib: float = 0.0) -> None:
    """ValueError, naming generator.gpu_memory_utilization (generator.kv_cache_gib where the
    recipe sizes the KV cache itself) and the value that fits, when the weight sync (`need`
    bytes, sync_need_bytes) does not fit the `free` bytes vLLM left."""
    if need + SYNC_MARGIN <= free:
        return
    short = need + SYNC_MARGIN - free
    if kv_cache_gib > 0:
        key, value = "generator.kv_cache_gib", kv_cache_gib
        fits = math.floor((kv_cache_gib - short / GIB) * 100) / 100
    else:
        key, value = "generator.gpu_memory_utilization", utilization
        fits = utilization_that_fits(need, free, total, utilization)
    fix = (f"set {key}={fits:.2f} or lower" if fits > 0 else
           "the model is too large for one GPU per engine: use generator.tp > 1")
    raise ValueError(
        f"the weight sync needs {need / GIB:.3g} GiB of GPU memory beside the engine "
        f"(receive buffers for {senders} trainer rank(s), and the first sync's tensors put "
        f"together), plus {SYNC_MARGIN / GIB:.3g} GiB of margin, but vLLM left "
        f"{free / GIB:.3g} GiB free under {key}={value:g}: {fix} (docs/generator.md, "
        "GPU memory)")


def model_bytes_from_config(config: dict, dtype_bytes: int = 2) -> int:
    """Bytes of a Llama/Qwen2-style decoder's parameters, from its config.json: embeddings,
    per layer q/k/v/o (with q/k/v biases where the architecture has them) + gated MLP + two
    norms, the final norm, and the output head unless tied to the embeddings."""
    cfg = config.get("text_config", config)
    h, v, n_layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]
    bias = cfg.get("attention_bias", cfg.get("model_type") == "qwen2")
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if bias else 0)
    layer = attention + 3 * h * inter + 2 * h
    params = v * h + n_layers * layer + h
    if not cfg.get("tie_word_embeddings", False):
        params += v * h
    return params * dtype_bytes
