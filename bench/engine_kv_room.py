"""The KV cache a vLLM engine on this GPU keeps beside the weight sync's receive buffers: today's
(the whole model, generator/gpu_memory.py) against bucketed ones (two sync.bucket_mb buckets in
flight, the design issue 69 asks for), for Qwen2.5-0.5B's architecture (dummy weights: nothing
is downloaded). GPU and vLLM's CUDA build only; one JSON line on stdout.

Measured: the engine started at --utilization (llamarl's Engine, as a generator rank starts
it), its KV cache (vLLM's blocks x block size x bytes per token) and the GPU's free memory
after start. Derived (gpu_memory.utilization_that_fits, the start-up check's own arithmetic):
the highest gpu_memory_utilization that leaves each receive buffer plus SYNC_MARGIN free, and
the KV cache at it (the measured cache + the added share of the card: the weights and
activations vLLM holds do not grow with it).

    python bench/engine_kv_room.py [--utilization 0.5] [--bucket-mb 64]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                  tie_word_embeddings=True, max_position_embeddings=32768)


def model_dir() -> str:
    """Qwen2.5-0.5B's config.json and a character tokenizer (the engine loads dummy weights)."""
    from transformers import Qwen2Config

    from llamarl.tiny.model import build_tokenizer

    path = Path(tempfile.gettempdir()) / "llamarl-kv-room-0.5b"
    path.mkdir(exist_ok=True)
    Qwen2Config(**QWEN25_05B, bos_token_id=1, eos_token_id=2).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--utilization", type=float, default=0.5)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args()
    import torch

    from llamarl.config import GeneratorConfig
    from llamarl.generator.engine import Engine
    from llamarl.generator.gpu_memory import (
        GIB,
        SYNC_MARGIN,
        model_bytes_from_config,
        utilization_that_fits,
    )

    path = model_dir()
    cfg = GeneratorConfig(max_model_len=args.max_model_len, prompts_per_step=8,
                          samples_per_prompt=8, engines=1,
                          gpu_memory_utilization=args.utilization)
    engine = Engine(path, cfg, "bfloat16", 0, on_cpu=False, load_format="dummy")
    free, total = torch.cuda.mem_get_info()
    kv = engine.kv.cache_bytes if engine.kv is not None else None
    model = model_bytes_from_config(json.loads((Path(path) / "config.json").read_text()))
    out = {"gpu": torch.cuda.get_device_name(), "total_gib": total / GIB,
           "utilization": args.utilization, "free_after_start_gib": free / GIB,
           "kv_gib": None if kv is None else kv / GIB, "block_size": engine.block_size,
           "model_gib": model / GIB, "sync_margin_gib": SYNC_MARGIN / GIB}
    for name, need in (("whole_model_buffers", model),
                       ("bucketed_buffers", 2 * args.bucket_mb * (1 << 20))):
        u = utilization_that_fits(need, free, total, args.utilization)
        out[name] = {"need_gib": need / GIB, "utilization_that_fits": u,
                     "kv_gib_at_it": None if kv is None
                     else (kv + (u - args.utilization) * total) / GIB}
    print("ENGINE_KV_ROOM " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
