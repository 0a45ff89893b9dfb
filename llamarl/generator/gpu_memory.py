"""Does the weight sync fit the GPU memory a vLLM engine leaves free?

On a GPU, vLLM takes `gpu_memory_utilization` of the card for the model, its activations and
the KV cache, and leaves the rest: free = (1 - u) x total, less what other processes hold. The
weight sync's receiving end (parallel/weight_receiver.py) lives in that rest, and so does what
the engine creates after this check:

    receive buffers   one sender (sync.receive_buffers K > 0, tp 1 or not resharded): a pool
                      of K buffers the buckets take in turn (parallel/receive_pool.py): at most
                      K x the largest bucket, whatever the model's size.
                      Otherwise every sender's shard of every tensor, kept for the whole run:
                      the model's bytes, B
    first sync        (no pool) each tensor that arrives in pieces from several senders
                      (FSDP2 shards rows over T trainer ranks) is put together once, and kept
                      until the load is recorded: up to B more when T > 1
    slice buffers     (resharded tp > 1 engines, from the second sync) the blocks this tp rank
                      reads, estimated as B / tp (they are allocated while the first sync's
                      put-together tensors still exist)
    communicators     the NCCL groups this engine rank joins (parallel/plan.py, groups_of):
                      NCCL_COMM_BYTES each
    reward model      reward.model_placement generator: its weights, on the engine leader

    need = buffers + first sync + slices + communicators + reward model + SYNC_MARGIN

Qwen2.5-7B in bf16 is B = 14.2 GiB: without a pool, 28.4 GiB for T = 8, while u = 0.85 leaves
11.9 GiB of an 80 GB H100; with one sender and a pool of 4 buckets of 64 MiB the buffers are
2.28 GiB at the first sync (its embedding and head travel alone, 1.02 GiB each, and its MLP
matrices, 130 MiB), less after (buckets received straight into the engine take no slot).
The engine checks at start (worker_ext.llamarl_join_weight_sync), before it allocates
anything, and names the key and the value that fits; tests/test_gpu_path.py runs the same
arithmetic over every GPU recipe from its model's config.json.
"""

from __future__ import annotations

import math
from pathlib import Path

from llamarl.parallel.receive_pool import pool_slots, slot_sizes
from llamarl.parallel.weight_plan import TensorMeta, itemsize, plan_buckets, solo_bytes_of

GIB = 1 << 30
MIB = 1 << 20
SYNC_MARGIN = 1 * GIB  # the allocator's slack beside the sync's tensors
# GPU memory of one NCCL communicator: NVIDIA/nccl#964 measured 544-688 MB per communicator on
# A100 with NCCL's defaults (buffers of NCCL_BUFFSIZE = 4 MiB per channel and peer for each
# protocol, up to 32 channels); the low end, rounded down. Smaller with NCCL_BUFFSIZE or
# NCCL_MAX_NCHANNELS set lower, which this figure does not read.
NCCL_COMM_BYTES = 512 * MIB


def sync_need_bytes(metas_by_sender: list[list[TensorMeta]], bucket_mb: int = 64,
                    solo_mb: float | None = None, receive_buffers: int = 0, tp: int = 1,
                    reshard: bool = False, adapters: bool = False) -> int:
    """GPU bytes one engine rank's weight sync holds at its peak, from the senders' shard
    layouts and the receiver's settings (WeightReceiver's arguments): a pool's slots at the
    first sync (every bucket in a slot), or every piece's receive buffer, plus every tensor
    that comes in more than one piece, put together once, plus the slice buffers of a
    resharded tp > 1 engine (estimated: B / tp)."""
    resharded = tp > 1 and reshard
    slots = pool_slots(len(metas_by_sender), receive_buffers, not adapters, resharded)
    if slots is not None:
        plan = plan_buckets(metas_by_sender[0], bucket_mb << 20, solo_bytes_of(solo_mb))
        return sum(slot_sizes(plan, slots))
    buffers, pieces, full = 0, {}, {}
    for metas in metas_by_sender:
        for m in metas:
            size = m.numel * itemsize(m.dtype)
            buffers += size
            pieces[m.name] = pieces.get(m.name, 0) + 1
            full[m.name] = math.prod(m.shape) * itemsize(m.dtype)
    assembled = sum(full[name] for name, n in pieces.items() if n > 1)
    slices = -(-buffers // tp) if resharded else 0
    return buffers + assembled + slices


def later_bytes(communicators: int, reward_model: int = 0) -> dict[str, int]:
    """What an engine rank allocates after the check, by what it is (check_sync_fits names
    them): `communicators` NCCL groups it joins, and a generator-placed reward model."""
    out = {}
    if communicators:
        out[f"{communicators} NCCL communicator(s) at {NCCL_COMM_BYTES / MIB:.0f} MiB"] = (
            communicators * NCCL_COMM_BYTES)
    if reward_model:
        out["the reward model (reward.model_placement generator)"] = reward_model
    return out


def utilization_that_fits(need: int, free: int, total: int, utilization: float) -> float:
    """The largest gpu_memory_utilization (in hundredths) under which `need` + SYNC_MARGIN
    bytes stay free, given `free` bytes free under `utilization`."""
    short = need + SYNC_MARGIN - free
    return math.floor((utilization - short / total) * 100) / 100


def check_sync_fits(need: int, free: int, total: int, utilization: float,
                    senders: int, kv_cache_gib: float = 0.0,
                    later: dict[str, int] | None = None) -> None:
    """ValueError, naming generator.gpu_memory_utilization (generator.kv_cache_gib where the
    recipe sizes the KV cache itself) and the value that fits, when the weight sync (`need`
    bytes, sync_need_bytes) and what comes after the check (`later`, later_bytes) do not fit
    the `free` bytes vLLM left."""
    later = later or {}
    after = ", ".join(f"{what} ({n / GIB:.3g} GiB)" for what, n in later.items())
    sync_need = need
    need += sum(later.values())
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
        f"the weight sync needs {sync_need / GIB:.3g} GiB of GPU memory beside the engine "
        f"(receive buffers for {senders} trainer rank(s), and the first sync's tensors put "
        f"together){', then ' + after if after else ''}, plus {SYNC_MARGIN / GIB:.3g} GiB "
        f"of margin, but vLLM left "
        f"{free / GIB:.3g} GiB free under {key}={value:g}: {fix} (docs/generator.md, "
        "GPU memory)")


def reward_model_bytes(path: str) -> int:
    """Bytes of a reward model's weights as it loads them (dtype auto: as stored): its weight
    files, in the directory `path` or in the Hugging Face cache for a hub id (0 when neither
    holds them yet: it is then downloaded after the check, and not counted)."""
    directory = Path(path)
    if not directory.is_dir():
        try:
            from huggingface_hub import snapshot_download
            directory = Path(snapshot_download(path, local_files_only=True))
        except Exception:  # noqa: BLE001 - not in the cache (or not a hub id): nothing to count
            return 0
    files = list(directory.glob("*.safetensors")) or list(directory.glob("*.bin"))
    return sum(f.stat().st_size for f in files)


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
