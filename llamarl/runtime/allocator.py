"""glibc's malloc set to keep freed memory for reuse in a CPU rank, instead of handing every large
block back to the kernel and faulting it in again on the next allocation.

glibc serves an allocation above its mmap threshold (128 KiB at first, raised as such blocks
are freed, never above 32 MiB) with a fresh mmap, and unmaps it on free. The next tensor of that
size gets new pages, and the kernel zeroes and maps each 4 KiB page on first touch. A CPU RL
update allocates such tensors all the time: each chunk of the LM head's logits is 67 MB of
float32 ([341, 49152] on SmolLM2-135M), the embedding's gradient 113 MB, FSDP2's buffers tens of
MB. Measured on the 2-core machine (Intel, AMX; docs/measured.md):
  * a `.float()` of [341, 49152] bfloat16 logits: 15.9 ms with glibc's defaults, 4.5 ms with
    memory kept; `torch.empty_like(...).fill_(1)`: 15.0 against 4.0 ms;
  * SmolLM2's GRPO update (bench/trainer_throughput.py --model smollm2 --groups, the recipe's
    batch): 10.3 s with the defaults, 7.8 s with the two settings below, 7.4 s with tcmalloc
    preloaded (LD_PRELOAD, which vLLM's CPU docs recommend; a system library llamarl does not
    require). The numbers computed are the same bit for bit: only where memory comes from
    changes.

The settings (`mallopt`, glibc's documented knobs, also readable from the environment at a
process's start):
  * M_MMAP_MAX = 0: no allocation is served by mmap; all come from the heap, whose freed blocks
    malloc reuses;
  * M_TRIM_THRESHOLD = 2 GiB (mallopt takes an int): freed memory at the top of the heap is
    returned to the kernel only when more than that lies free there.
So a rank's resident memory stays near its peak use instead of falling between steps. torch
asks for 64-byte aligned blocks, a little more than a freed block of the same size holds, so a
size's first few allocations take fresh memory until freed neighbours merge; from then on they
reuse it (tests/test_allocator.py). The recipe's 30 steps: docs/measured.md has the peak.

`keep_freed_memory` applies both to this process (mallopt, effective for its later allocations)
and sets them in the environment for the processes it starts (a tp > 1 engine's workers), on
glibc only; a value the user set for either, or an allocator preloaded (LD_PRELOAD: tcmalloc,
jemalloc), is kept as it is. The launcher calls it in every rank placed on no GPU: a GPU rank's
large tensors live in the device's caching allocator, and its host side is left as it is.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_MAX = -4
TRIM_THRESHOLD = 2**31 - 1
SETTINGS = {"MALLOC_MMAP_MAX_": (M_MMAP_MAX, 0),
            "MALLOC_TRIM_THRESHOLD_": (M_TRIM_THRESHOLD, TRIM_THRESHOLD)}


def keep_freed_memory(environ: dict | None = None) -> bool:
    """Set glibc's malloc to reuse freed memory (module docstring) in this process and, through
    `environ` (default os.environ), in the processes it starts. Returns whether it did: False on
    another C library, with an allocator preloaded, or when the user set either knob."""
    env = os.environ if environ is None else environ
    if platform.libc_ver()[0] != "glibc" or env.get("LD_PRELOAD", "").strip():
        return False
    if any(name in env for name in SETTINGS):
        return False
    libc = ctypes.CDLL(None)
    for name, (param, value) in SETTINGS.items():
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            return False
        env[name] = str(value)
    return True
