"""The update of a bfloat16 model on the CPU with its attention in bfloat16 against the same
with the attention in float32 (trainer/varlen_attention.py: CPU_HALF_IN_FLOAT32), and the
float32 model beside them: the same GRPO update of the same batch, the three taking turns in
one process, so the machine's drift hits all alike.

    float32         model.dtype float32
    bf16_attn_bf16  model.dtype bfloat16 (FSDP2 mixed precision over float32 masters), the
                    attention in bfloat16 (torch's CPU flash kernel; before 2026-11-27)
    bf16            model.dtype bfloat16, the attention in float32 (q, k, v cast up, the
                    output cast back: what llamarl does now)

Workloads as bench/micro_batch_order.py's: `tiny` (the 2-engine recipe's update, 64 prompts
x 8 samples, micro-batches of 256 samples, shared prompts) and `gen24m` (the 24M model, long
answers). Reports the median and minimum seconds per update over --repeats and each
median's ratio to float32's; written to bench/results/cpu_half_attention[_gen24m].json, with
the schema's keys of bench/harness.py.

    python bench/cpu_half_attention.py                     # part of make bench
    python bench/cpu_half_attention.py --workload gen24m
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from micro_batch_order import WORKLOADS, finish, recipe_batch, setup
from torch.distributed.device_mesh import init_device_mesh

# (micro-batch rows, batch shape): micro_batch_order's batches, the tiny one in the 2-engine
# recipe's micro-batches of 256
SHAPES = {"tiny": (256, WORKLOADS["tiny"][2]), "gen24m": (32, WORKLOADS["gen24m"][2])}
VARIANTS = {"float32": (torch.float32, True), "bf16_attn_bf16": (torch.bfloat16, False),
            "bf16": (torch.bfloat16, True)}


def main() -> None:
    args, repeats, path = setup("cpu_half_attention", __doc__, "variant", 4)
    from transformers import AutoTokenizer

    from llamarl.config import load_config
    from llamarl.parallel.fsdp import apply_fsdp
    from llamarl.trainer import rl_step, varlen_attention
    from llamarl.trainer.policy import load_policy
    from llamarl.trainer.step import PolicyTrainer

    rows, shape = SHAPES[args.workload]
    tok = AutoTokenizer.from_pretrained(path)
    cfg = load_config(None, [f"trainer.micro_batch_size={rows}", "trainer.ranks=1"])
    mesh = init_device_mesh("cpu", (1,))
    trainers = {}
    for name, (dtype, _) in VARIANTS.items():
        model = load_policy(str(path), "float32")  # the masters; FSDP2 casts for compute
        apply_fsdp(model, mesh, dtype)
        trainers[name] = PolicyTrainer(model, cfg.trainer, 10_000, 1, torch.device("cpu"))
    batch = recipe_batch(vocab=trainers["float32"].model.config.vocab_size, seed=0, **shape)
    times = {name: [] for name in VARIANTS}
    for i in range(repeats + 1):
        for name, trainer in trainers.items():
            varlen_attention.CPU_HALF_IN_FLOAT32 = VARIANTS[name][1]
            t0 = time.perf_counter()
            rl_step.policy_step(trainer, batch, cfg, tok.pad_token_id)
            if i:  # the first of each is warm-up
                times[name].append(time.perf_counter() - t0)
    varlen_attention.CPU_HALF_IN_FLOAT32 = True
    out = {"workload": args.workload, "threads": args.threads, "repeats": repeats,
           "micro_batch_size": rows, "shape": {k: list(v) if isinstance(v, tuple) else v
                                              for k, v in shape.items()}}
    for name in VARIANTS:
        out[name] = {"update_s_median": statistics.median(times[name]),
                     "update_s_min": min(times[name]), "update_s_all": times[name]}
    for name in VARIANTS:
        out[f"{name}_over_float32"] = (out[name]["update_s_median"]
                                       / out["float32"]["update_s_median"])
    out["bf16_over_bf16_attn_bf16"] = (out["bf16"]["update_s_median"]
                                       / out["bf16_attn_bf16"]["update_s_median"])
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, dict)
                      or "update_s_all" not in v} | {
        n: round(out[n]["update_s_median"], 4) for n in VARIANTS}, indent=1))
    finish("cpu_half_attention", args, out, path)


if __name__ == "__main__":
    main()
