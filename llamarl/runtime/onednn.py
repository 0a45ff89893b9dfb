"""A bound on oneDNN's primitive cache, so that a CPU rank's memory stops growing with every
new tensor shape.

On CPU, torch runs bfloat16 matmuls through oneDNN (where the CPU has AVX-512, AMX or Arm
BF16: an AVX2-only CPU runs them in a slow fallback with no cache, llamarl/models/precision.py,
and model.dtype = auto picks float32 there), which keeps every primitive it creates (the
JIT-compiled kernel and its descriptors, keyed by shapes) in a process-wide cache of
ONEDNN_PRIMITIVE_CACHE_CAPACITY entries, 1024 by default. An RL update sees new shapes at every
step (each micro-batch is as long as its longest sequence), so the cache keeps filling for
hundreds of steps, and on SmolLM2-135M (recipes/smollm2_add_cpu.yaml, bfloat16) the trainer
rank's peak resident memory grew at every step: 4.8 GiB at step 2, 8.5 GiB at step 30, as the
responses got shorter. Float32 matmuls (the tiny recipes) go through another BLAS and were not
affected (bench/soak.py: 1.3% over 800 steps).

Measured on that recipe, 10 steps each, the 2-core machine alone (docs/measured.md):
  * default: peak 3.6 -> 5.5 GiB by step 10 (and on to 8.5 at step 30);
  * capacity 8 (with glibc's free memory trimmed after each step, to see what stays): the
    peak flat at 4.5 GiB from step 2 on, the update as fast (12.6-17 s a step, against 14-16);
  * capacity 64, the one set here: the peak 3.8 GiB at step 1, 4.8 GiB from step 5 to 10, the
    update as fast (12.5-16.8 s); over 30 steps 5.2 GiB at step 30 (against 8.5), the resident
    memory level from step 19 on;
  * glibc's mmap threshold fixed at 256 KiB instead (every large tensor returned at once): the
    peak flat too, but the update 40% slower and the engine 50% (page faults).
64 holds more than the distinct matmul shapes of one micro-batch's forward and backward (the
decoder's 4 weight shapes x forward, backward-data and backward-weights, and the head), so a
step reuses its primitives across layers; 8 made a synthetic loop of 200 shapes 1.26x slower,
64 1.07x.

`cap_primitive_cache` sets it in the environment before torch creates its first primitive
(oneDNN reads it once); a value the user set is kept.
"""

from __future__ import annotations

import os

PRIMITIVE_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
PRIMITIVE_CACHE_CAPACITY = "64"


def cap_primitive_cache() -> None:
    """Bound oneDNN's primitive cache (module docstring), unless the user set it."""
    os.environ.setdefault(PRIMITIVE_CACHE_ENV, PRIMITIVE_CACHE_CAPACITY)
