"""model.dtype = auto: the compute dtype this host runs fastest, and a warning for a bfloat16
that the host cannot run fast.

On a CPU, torch's bfloat16 matrix products are fast only through oneDNN, which needs AVX-512
(emulated bfloat16, avx512_core), AVX-512 BF16 or AMX on x86, or BF16 on Arm
(torch.ops.mkldnn._is_mkldnn_bf16_supported). Elsewhere, an AVX2-only x86 such as AMD's
Zen 2/3 EPYCs, they fall back to a generic loop. Measured on such a 2-core EPYC (torch 2.13,
2 threads; bench/cpu_dtype_matmul.py, docs/measured.md): against float32, a 2048-square
product 300x slower (61 s against 0.20 s), SmolLM2's LM-head weight gradient ([49152, 341] x
[341, 576]) 20x, an MLP's input gradient 79x, its forward 7x; a bfloat16 update of
recipes/smollm2_add_cpu.yaml did not finish its first micro-batch in 7 minutes, where the
float32 update takes 35-50 s. float32 is then the fast dtype, and it also learns more per
step (docs/measured.md, the precision experiment).

`auto` resolves once per process, when the recipe is loaded (config.load_config), so every
later reader sees a concrete dtype, and the run directory's recipe.yaml records it (a resume
reads the same). Every process of a job on one host resolves it alike; a CPU job spread over
hosts with different CPUs should name the dtype.

A GPU host (any GPU visible through NVML, which does not initialise CUDA: runtime/gpus.py
places the ranks first) resolves to bfloat16: every GPU llamarl's GPU recipes target has it.
"""

from __future__ import annotations

import torch

AUTO = "auto"


def cpu_bfloat16_is_fast() -> bool:
    """Whether this CPU's torch bfloat16 matrix products go through oneDNN (see above)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the op: AVX-512 as the proxy
        return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def has_gpu() -> bool:
    """A GPU is visible (NVML first: CUDA is not initialised, runtime/gpus.py)."""
    return torch.cuda.device_count() > 0


def resolve_dtype(dtype: str) -> str:
    """model.dtype with `auto` replaced: bfloat16 on a GPU host or a CPU with fast bfloat16
    products, else float32. Other values are returned as they are."""
    if dtype != AUTO:
        return dtype
    return "bfloat16" if has_gpu() or cpu_bfloat16_is_fast() else "float32"


def slow_dtype_warning(dtype: str) -> str | None:
    """One line when a half-precision model.dtype will run on a CPU without fast products for
    it, else None."""
    if dtype not in ("bfloat16", "float16") or has_gpu() or cpu_bfloat16_is_fast():
        return None
    return (f"llamarl: warning: model.dtype={dtype} on a CPU without {dtype} matrix products "
            f"({torch.backends.cpu.get_cpu_capability()}, no AVX-512 or AMX): torch runs them "
            "in a fallback loop, 7-300x slower than float32 on such a CPU; set model.dtype=auto "
            "(float32 on this CPU) or float32")
