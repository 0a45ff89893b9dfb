"""float32 against bfloat16 matrix products on this CPU, on the shapes of SmolLM2's update: why
model.dtype = auto picks float32 on a CPU without bfloat16 products (llamarl/models/precision.py).

    python bench/cpu_dtype_matmul.py   # a table; bench/results/cpu_dtype_matmul_<avx2|...>.json

Each product runs once to warm up, then `--repeats` times (fewer for a product over 10 s); the
median is reported (each product's repeats under "float32_s_all" and "bfloat16_s_all"; the
file has the schema's keys of bench/harness.py). Shapes (torch's threads as the recipe's rank
gets them: 2 on the 2-core machine):
  square        [2048, 2048] x [2048, 2048]                      17.2 GFLOP
  linear        [740, 576] x [576, 1536]^T   a micro-batch's MLP up-projection, forward
  grad_input    [740, 1536] x [1536, 576]    its input gradient (g @ W)
  grad_weight   [1536, 740] x [740, 576]     its weight gradient (g^T @ x)
  head_grad     [49152, 341] x [341, 576]    one chunk of the LM head's weight gradient
                                             (trainer/linear_logprobs.py: dW.addmm_(gz^T, h))
"""

from __future__ import annotations

import platform
import time

import torch
from harness import RESULTS, bench_parser, median, time_calls, write_result


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


def time_one(a, b, b_t, repeats: int) -> list[float]:
    """Seconds of each timed run of the product (one, when the warm-up took over 10 s)."""
    t0 = time.perf_counter()
    product(a, b, b_t)  # warm-up (oneDNN creates its primitive)
    first = time.perf_counter() - t0
    return time_calls(lambda: product(a, b, b_t), 1 if first > 10 else repeats, warmup=0)


def main() -> None:
    # --out's default, bench/results/cpu_dtype_matmul_<torch's CPU capability>.json, is named
    # once the capability is known
    args = bench_parser("cpu_dtype_matmul", __doc__, repeats=5, out="").parse_args()
    from llamarl.models.precision import cpu_bfloat16_is_fast, resolve_dtype

    torch.manual_seed(0)
    rows = {}
    for name, (sa, sb, b_t) in shapes().items():
        a32, b32 = torch.randn(*sa), torch.randn(*sb)
        m, k = (sa[1], sa[0]) if b_t is None else sa
        n = sb[0] if b_t else sb[1]
        gflop = 2 * m * n * k / 1e9
        f32_all = time_one(a32, b32, b_t, args.repeats)
        b16_all = time_one(a32.bfloat16(), b32.bfloat16(), b_t, args.repeats)
        f32, b16 = median(f32_all), median(b16_all)
        rows[name] = {"gflop": round(gflop, 2), "float32_s": round(f32, 4),
                      "bfloat16_s": round(b16, 4), "bfloat16_over_float32": round(b16 / f32, 2),
                      "float32_s_all": [round(x, 4) for x in f32_all],
                      "bfloat16_s_all": [round(x, 4) for x in b16_all]}
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
    path = write_result("cpu_dtype_matmul", out, args, out=args.out or RESULTS /
                        f"cpu_dtype_matmul_{out['capability'].lower()}.json")
    print(f"{out['capability']}, fast bfloat16: {out['cpu_bfloat16_is_fast']}, auto -> "
          f"{out['auto_resolves_to']}; wrote {path}")


if __name__ == "__main__":
    main()
