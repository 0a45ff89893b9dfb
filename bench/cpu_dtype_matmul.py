"""float32 against bfloat16 matrix products on this CPU, on the shapes of SmolLM2's update: why
model.dtype = auto picks float32 on a CPU without bfloat16 products (llamarl/models/precision.py).

    python bench/cpu_dtype_matmul.py   # a table; bench/results/cpu_dtype_matmul_<avx2|...>.json

Each product runs once to warm up, then `--repeats` times (fewer for a product over 10 s); the
median is reported. Shapes (torch's threads as the recipe's rank gets them: 2 on the 2-core
machine):
  square        [2048, 2048] x [2048, 2048]                      17.2 GFLOP
  linear        [740, 576] x [576, 1536]^T   a micro-batch's MLP up-projection, forward
  grad_input    [740, 1536] x [1536, 576]    its input gradient (g @ W)
  grad_weight   [1536, 740] x [740, 576]     its weight gradient (g^T @ x)
  head_grad     [49152, 341] x [341, 576]    one chunk of the LM head's weight gradient
                                             (trainer/linear_logprobs.py: dW.addmm_(gz^T, h))
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def shapes() -> dict[str, tuple[tuple[int, ...], tuple[int, ...], bool]]:
    """name -> (a's shape, b's shape, b is used transposed)."""
    return {"square": ((2048, 2048), (2048, 2048), False),
            "linear": ((740, 576), (1536, 576), True),
            "grad_input": ((740, 1536), (1536, 576), False),
            "grad_weight": ((740, 1536), (740, 576), None),  # a^T @ b
            "head_grad": ((341, 49152), (341, 576), None)}


def product(a: torch.Tensor, b: torch.Tensor, b_t: bool | None) -> torch.Tensor:
    if b_t is None:
        return a.t() @ b
    return torch.nn.functional.linear(a, b) if b_t else a @ b


def time_one(a, b, b_t, repeats: int) -> float:
    t0 = time.perf_counter()
    product(a, b, b_t)  # warm-up (oneDNN creates its primitive)
    first = time.perf_counter() - t0
    n = 1 if first > 10 else repeats
    runs = []
    for _ in range(n):
        t0 = time.perf_counter()
        product(a, b, b_t)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="", help="default: bench/results/cpu_dtype_matmul_"
                   "<torch's CPU capability>.json")
    args = p.parse_args()
    from llamarl.models.precision import cpu_bfloat16_is_fast, resolve_dtype

    torch.manual_seed(0)
    rows = {}
    for name, (sa, sb, b_t) in shapes().items():
        a32, b32 = torch.randn(*sa), torch.randn(*sb)
        m, k = (sa[1], sa[0]) if b_t is None else sa
        n = sb[0] if b_t else sb[1]
        gflop = 2 * m * n * k / 1e9
        f32 = time_one(a32, b32, b_t, args.repeats)
        b16 = time_one(a32.bfloat16(), b32.bfloat16(), b_t, args.repeats)
        rows[name] = {"gflop": round(gflop, 2), "float32_s": round(f32, 4),
                      "bfloat16_s": round(b16, 4), "bfloat16_over_float32": round(b16 / f32, 2)}
        print(f"{name:12s} {gflop:6.2f} GFLOP  float32 {f32:8.4f} s  bfloat16 {b16:8.4f} s  "
              f"{b16 / f32:7.2f}x", flush=True)
    out = {"cpu": platform.processor() or platform.machine(),
           "capability": torch.backends.cpu.get_cpu_capability(),
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           "cpu_bfloat16_is_fast": cpu_bfloat16_is_fast(), "auto_resolves_to":
           resolve_dtype("auto"), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "products": rows}
    try:
        out["model_name"] = next(line.split(":", 1)[1].strip() for line in
                                 open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    path = Path(args.out or ROOT / "bench/results" /
                f"cpu_dtype_matmul_{out['capability'].lower()}.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{out['capability']}, fast bfloat16: {out['cpu_bfloat16_is_fast']}, auto -> "
          f"{out['auto_resolves_to']}; wrote {path}")


if __name__ == "__main__":
    main()
