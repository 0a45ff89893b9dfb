"""torchrun --nproc-per-node 2 (1 trainer rank + 1 engine rank) on a GPU machine: each rank is
placed as `python -m llamarl.launch` places it (runtime/gpus.py, before CUDA starts), then sets
up llamarl's runtime and writes, to $OUT.<rank>, what it sees: CUDA_VISIBLE_DEVICES, its device,
and the UUID of the GPU behind it; the generator also the GPU vLLM's worker would take (the
single-process executor's `cuda` -> local rank 0, tests/test_gpu_path.py). vLLM itself is not
needed: the engine is not started."""

import json
import os

from llamarl.config import load_config
from llamarl.runtime.dist_env import from_environ
from llamarl.runtime.gpus import apply_placement
from llamarl.runtime.layout import compute_layout

if __name__ == "__main__":
    env = from_environ()
    layout = compute_layout(env.world_size, env.local_world_size, 1, 1, 1)
    placement = apply_placement(layout, env.rank, env.local_rank)
    import torch

    from llamarl.runtime.setup import setup

    cfg = load_config(None, ["trainer.ranks=1", f"run.output_dir={os.environ['RUNS']}"])
    rt = setup(cfg, layout, env)
    torch.cuda.set_device(rt.device)
    vllm_index = 0  # UniProcExecutor._distributed_args: DeviceConfig's bare "cuda"
    out = {"rank": env.rank, "role": rt.role.role, "device": str(rt.device),
           "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "index": placement.index,
           "uuid": str(torch.cuda.get_device_properties(rt.device).uuid),
           "vllm_uuid": str(torch.cuda.get_device_properties(vllm_index).uuid),
           "device_count": torch.cuda.device_count()}
    with open(f"{os.environ['OUT']}.{env.rank}", "w") as f:
        json.dump(out, f)
    rt.watchdog.mark_done()
    rt.watchdog.stop()
    os._exit(0)
