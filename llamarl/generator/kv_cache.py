"""How much KV cache an engine needs for its workload, and what to tell the user about it.

One generate call runs up to S sequences at once (a training batch: prompts_per_step / engines x
samples_per_prompt; a held-out evaluation: its prompts x eval_samples_per_prompt). Each sequence
can grow to max_model_len tokens, held in whole blocks of `block` tokens, and each token keeps a
key and a value per layer and KV head:

    bytes_per_token = 2 x layers x ceil(kv_heads / tp) x head_dim x dtype_bytes
    need            = S x ceil(max_model_len / block) x block x bytes_per_token

With less cache than `need`, vLLM preempts running sequences and recomputes them later: correct
(the sampler draws from one generator per call, see engine.py), but slower. With less than one
sequence at full length vLLM refuses to start, so that is a start-up error here, naming the key.

`generator.kv_cache_gib = 0` (the default) sizes the CPU cache to `need`, bounded by half the
memory available on the host at start, shared by the engines there. On GPU vLLM sizes the cache
from `gpu_memory_utilization`; the engine reports what it got against `need` after start.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1 << 30
# vLLM's default block sizes (tokens per KV block).
VLLM_DEFAULT_BLOCK = {"cpu": 128, "gpu": 16}
# vLLM's CPU attention takes blocks of a multiple of 32 tokens ("No common block size for 16
# (CPU_ATTN: [MultipleOf(32)])"); 32 is the smallest, and so the one that shares the most.
CPU_BLOCK_MULTIPLE = 32
# Sequences at least this long get CPU_BLOCK_MULTIPLE-token blocks under generator.block_size = 0.
CPU_SHARING_MIN_LEN = 128
# Of the memory available at start, the share all engines of a host may take for KV.
HOST_SHARE = 0.5


def default_block_size(on_cpu: bool, max_model_len: int) -> int:
    """Tokens per KV block for generator.block_size = 0 (auto).

    GPU: vLLM's 16. CPU: 32 for sequences of at least 128 tokens, else vLLM's 128. vLLM's
    prefix cache reuses whole blocks only, so with 128-token blocks the samples of a group never
    shared their prompt: SmolLM2's 47-token prompts, 16 x 8 samples, were prefilled 128 times
    (4.2-5.4 s of a 9.5-10.6 s generate call on the 2-core CPU); with 32-token blocks each
    prompt's first block is computed once per group (prefill 1.7-2.8 s, the call 6.1-6.6 s;
    docs/measured.md), and a multi-turn episode reuses its earlier turns' blocks. The tiny
    recipes' 64-token sequences keep 128 (their prompts, at most 8 tokens, fill no block at
    any size) with the prefix cache off (engine.py), as before.
    """
    if not on_cpu:
        return VLLM_DEFAULT_BLOCK["gpu"]
    if max_model_len >= CPU_SHARING_MIN_LEN:
        return CPU_BLOCK_MULTIPLE
    return VLLM_DEFAULT_BLOCK["cpu"]


def check_block_size(block_size: int, on_cpu: bool) -> None:
    """A one-line ValueError for a CPU block size vLLM's CPU attention refuses (the config's
    check, a multiple of 16, is the GPU kernels'; the config does not know the device)."""
    if on_cpu and block_size % CPU_BLOCK_MULTIPLE:
        raise ValueError(f"generator.block_size={block_size}: vLLM's CPU attention takes "
                         f"multiples of {CPU_BLOCK_MULTIPLE} tokens; set {CPU_BLOCK_MULTIPLE} "
                         "(or 0 for auto)")


def kv_bytes_per_token(model_path: str | Path, dtype: str, tp: int = 1) -> int:
    """KV bytes one token takes in one tp rank of the engine, from the model's config.json."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)  # multimodal configs nest the language model's
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * math.ceil(kv_heads / tp) * head_dim * DTYPE_BYTES[dtype]


def check_model_context(model_path: str | Path, max_model_len: int) -> None:
    """ValueError when generator.max_model_len is longer than the model's positions
    (max_position_embeddings in its config.json): vLLM refuses such an engine with a
    pydantic error that names none of the recipe's keys."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    positions = cfg.get("max_position_embeddings")
    if positions and max_model_len > positions:
        raise ValueError(f"generator.max_model_len {max_model_len} is longer than the model's "
                         f"context of {int(positions)} tokens (max_position_embeddings in "
                         f"{Path(model_path) / 'config.json'}): set generator.max_model_len "
                         f"<= {int(positions)}")


def sequence_bytes(max_model_len: int, block: int, bytes_per_token: int) -> int:
    """KV bytes of one sequence at full length: whole blocks of `block` tokens."""
    return math.ceil(max_model_len / block) * block * bytes_per_token


def available_memory_bytes() -> int:
    """MemAvailable of this host (Linux), else the physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class KVPlan:
    """The KV cache of one engine (per tp rank) and the workload it was sized for."""

    cache_bytes: int  # what the engine gets
    need_bytes: int  # every sequence of the largest generate call at full length
    seq_bytes: int  # one sequence at full length (vLLM's minimum)
    sequences: int  # sequences of the largest generate call
    max_model_len: int
    bytes_per_token: int
    auto: bool  # sized here (generator.kv_cache_gib = 0), not given by the user
    gpu: bool = False  # sized by vLLM from generator.gpu_memory_utilization

    @property
    def fits(self) -> int:
        """Sequences at full length the cache holds at once."""
        return self.cache_bytes // self.seq_bytes

    def describe(self) -> str:
        how = ("generator.kv_cache_gib=0: sized for the workload" if self.auto
               else "generator.gpu_memory_utilization" if self.gpu else "generator.kv_cache_gib")
        fix = (f"raise generator.gpu_memory_utilization ({self.need_bytes / GIB:.3g} GiB of KV "
               "holds them all)" if self.gpu else
               f"generator.kv_cache_gib={math.ceil(self.need_bytes / GIB * 100) / 100} avoids it")
        line = (f"KV cache {self.cache_bytes / GIB:.3g} GiB ({how}): a batch runs "
                f"{self.sequences} sequences x {self.max_model_len} tokens x "
                f"{self.bytes_per_token / 1024:.3g} KiB/token = {self.need_bytes / GIB:.3g} GiB")
        if self.fits < self.sequences:
            line += (f"; the cache holds {self.fits} of them at full length, so vLLM will "
                     f"preempt and recompute (correct, slower): {fix}")
        return line


def plan_kv_cache(bytes_per_token: int, sequences: int, max_model_len: int, block: int,
                  kv_cache_gib: float, engines_on_host: int = 1,
                  available: int | None = None) -> KVPlan:
    """Size the CPU KV cache (kv_cache_gib = 0: from the workload) and check it can work.

    Raises ValueError when not even one sequence of max_model_len tokens fits."""
    seq_bytes = sequence_bytes(max_model_len, block, bytes_per_token)
    need = sequences * seq_bytes
    if kv_cache_gib > 0:
        cache = int(kv_cache_gib * GIB)
        if cache < seq_bytes:
            raise ValueError(
                f"generator.kv_cache_gib = {kv_cache_gib} holds less than one sequence of "
                f"generator.max_model_len = {max_model_len} tokens ({seq_bytes / GIB:.3g} GiB): "
                f"raise it to at least {seq_bytes / GIB:.3g} GiB ({need / GIB:.3g} GiB holds a "
                f"whole batch of {sequences} sequences), or lower max_model_len")
        return KVPlan(cache, need, seq_bytes, sequences, max_model_len, bytes_per_token, False)
    available = available_memory_bytes() if available is None else available
    bound = int(available * HOST_SHARE / max(1, engines_on_host))
    if bound < seq_bytes:
        raise ValueError(
            f"this host has {available / GIB:.3g} GiB available, too little for the KV cache of "
            f"even one sequence of generator.max_model_len = {max_model_len} tokens "
            f"({seq_bytes / GIB:.3g} GiB per engine): lower generator.max_model_len, or free "
            "memory and set generator.kv_cache_gib explicitly")
    return KVPlan(min(need, bound), need, seq_bytes, sequences, max_model_len, bytes_per_token,
                  True)
