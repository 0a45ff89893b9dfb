"""Methods added to every vLLM worker (`LLM(worker_extension_cls=...)`), called through
`llm.collective_rpc("llamarl_*")`, or directly for the weight sync's hot path (Engine.worker: the
worker lives in the engine's own process). Names carry the `llamarl_` prefix so they never clash
with vLLM's own Worker methods.

They run where the model lives: in the generator process (in-process engine; with tp > 1 each
tp rank's process, generator/tp.py), so every tp rank opens its end of the weight sync and loads
its own shards (vLLM's `load_weights` slices full tensors for tensor parallelism).
"""

from __future__ import annotations

import numpy as np
import torch

from llamarl.generator.cpu_fixes import disable_onednn_prepack
from llamarl.generator.gpu_memory import GIB, check_sync_fits, sync_need_bytes
from llamarl.generator.lora_adapter import EngineAdapter
from llamarl.parallel.groups import post_from_root
from llamarl.parallel.transports.base import TransportSpec
from llamarl.parallel.weight_plan import OTHER_TAGS, metas_from_json
from llamarl.parallel.weight_sync import open_weight_sync

# Runs at import, which vLLM does before the worker loads the model (see cpu_fixes).
disable_onednn_prepack()


class LlamarlWorkerExtension:
    def llamarl_join_weight_sync(self, spec: TransportSpec, metas_json: list[str],
                                 bucket_mb: int, solo_mb: float | None = None,
                                 adapter: dict | None = None, receive_buffers: int = 0,
                                 later: dict[str, int] | None = None) -> int:
        """Open the receiving end of the weight sync (trainer rank i's shard layout:
        metas_json[i]); returns the number of senders. `adapter` (model.lora.sync adapters:
        lora_adapter.adapter_config): the syncs bring LoRA adapters, loaded as the engine's
        adapter (lora_adapter.EngineAdapter), not weights. `receive_buffers`: the pool's
        size (sync.receive_buffers); `later`: what this rank allocates after the memory
        check (gpu_memory.later_bytes), which the check counts."""
        device = torch.device(self.device) if hasattr(self, "device") else torch.device("cpu")
        metas = [metas_from_json(m) for m in metas_json]
        if device.type == "cuda":
            torch.cuda.set_device(device)
            # before anything is allocated: does the sync fit what vLLM left free?
            free, total = torch.cuda.mem_get_info(device)
            cache = self.cache_config
            need = sync_need_bytes(metas, bucket_mb, solo_mb, receive_buffers, spec.tp,
                                   spec.reshard, adapter is not None)
            check_sync_fits(need, free, total, cache.gpu_memory_utilization, spec.senders,
                            (cache.kv_cache_memory_bytes or 0) / GIB, later)
        self._llamarl_receiver = open_weight_sync(
            "receive", spec, bucket_mb, device, solo_mb, metas=metas,
            adapters=adapter is not None, receive_buffers=receive_buffers)
        # where each sync goes: the engine's model (its load_weights), or its adapter
        self._llamarl_target = (self.model_runner.model if adapter is None else
                                EngineAdapter(self, adapter, {m.name for ms in metas for m in ms},
                                              device))
        return spec.senders

    def llamarl_worker(self) -> LlamarlWorkerExtension:
        """This worker itself, for an engine in the same process to call directly."""
        return self

    def llamarl_post_receives(self) -> None:
        """Post the receives of the next weight sync and return (see WeightReceiver.post)."""
        self._llamarl_receiver.post()

    def llamarl_load_received(self) -> int:
        """Wait for the sync posted and load it into the model."""
        return self._llamarl_receiver.load(self._llamarl_target)

    def llamarl_receive_raw(self, nbytes: list[int], chunk_bytes: int, p2p: bool = False) -> int:
        """Receive nbytes[r] bytes from each trainer rank r on its weight group, in broadcasts
        (with `p2p`: gloo's point-to-point messages, see groups.point_to_point) of at most
        `chunk_bytes`, all posted at once, and discard them: the raw transfers that a weight
        sync is measured against (bench/weight_sync.py)."""
        receiver = self._llamarl_receiver
        if not hasattr(self, "_llamarl_raw"):
            self._llamarl_raw = {}  # receive buffers by sizes, reused like the weights' ones
        key = tuple(nbytes)
        if key not in self._llamarl_raw:
            self._llamarl_raw[key] = [torch.empty(n, dtype=torch.uint8, device=receiver.device)
                                      for n in nbytes]
        works = []
        for group, buf in zip(receiver.transport.groups, self._llamarl_raw[key]):
            works += [post_from_root(group, chunk, OTHER_TAGS + i, p2p)
                      for i, chunk in enumerate(buf.split(chunk_bytes))]
            if not p2p:  # broadcasts: sender by sender, as a weight sync's (WeightReceiver)
                for work in works:
                    work.wait()
        for work in works:
            work.wait()
        return sum(nbytes)

    def llamarl_state_checksum(self) -> float:
        """Sum of all parameters, and of the LoRA adapter's buffers under adapter-only syncs:
        a cheap check that weights changed (tests)."""
        total = float(sum(p.detach().double().sum()
                          for p in self.model_runner.model.parameters()))
        target = getattr(self, "_llamarl_target", None)
        return total + (target.checksum() if isinstance(target, EngineAdapter) else 0.0)

    def llamarl_seed_sampler(self, seed: int) -> None:
        """Seed the generators vLLM's sampler draws from (requests carry no seed of their
        own), in this process, where the sampler runs (Engine.generate):

        * torch's default generators: vLLM's CPU sampler and the GPU Model Runner V1 draw
          their noise from them;
        * numpy's global generator: on CUDA with Triton vLLM 0.32 runs Model Runner V2,
          whose Gumbel sampler gives each request without a seed one drawn from
          `np.random.randint` when the request is added (v1/worker/gpu/sample/states.py),
          and its noise is a function of that seed and the position alone. Seeded here,
          the requests of a call get their seeds in the order they are added, which
          depends on the call alone (its prompts, in order)."""
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
