"""The engine's LoRA adapter under adapter-only weight syncs (model.lora.sync adapters;
docs/trainer.md: LoRA): the engine runs the base model with vLLM's LoRA layers, and each sync
brings the policy's adapters, which replace the engine's one adapter in memory.

The trainer sends, for every adapted linear, A [r, in] and B [out, r] in PEFT's saved names
(`base_model.model.<module>.lora_A.weight`, trainer/lora.adapter_name). vLLM computes

    y = W x + B' (A x),   B' = s * B,  s = alpha / r

where the scaling is folded into B when the adapter is added (`LoRALayerWeights.optimize`,
called by the manager's `_create_merged_loras_inplace`: in place, so the tensors handed over
must be vLLM's own, not the receive buffers), and the q/k/v and gate/up adapters are packed
for vLLM's fused linears. Every request carries `lora_request()` (Engine.generate, _add),
which names the adapter by its id; the prefix cache holds no KV across a load (Engine.begin,
resume).

vLLM's public way to load an adapter is from a directory (`LoRARequest(path)`, PEFT's
adapter_config.json + adapter_model.safetensors, `load_inplace=True` to reload one). This
module skips the file round trip and uses the names the directory loader itself uses
(`WorkerLoRAManager._load_adapter`, vllm/lora/worker_manager.py, vLLM 0.32):

    LoRAModel.from_lora_tensors(id, tensors, PEFTHelper.from_dict(config), device, dtype)
    worker.model_runner.lora_manager._adapter_manager   the LoRAModelManager, whose
        remove_adapter(id), add_adapter(lora), activate_adapter(id)
                                                    swap it in (activate: set_lora copies A
                                                    and B into the layers' stacked buffers,
                                                    sliced for tp > 1)
        supported_lora_modules, packed_modules_mapping, model, modules, lora_config
                                                    what the engine's model can adapt

They are private: `EngineAdapter` reads them in one place and fails in one line, naming the
vLLM that was checked, when one is missing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from llamarl.config import VLLM_LORA_RANKS

ADAPTER_ID = 1  # the engine's one adapter (max_loras = 1), refreshed in place every sync
ADAPTER_NAME = "llamarl-policy"
# LoRARequest requires a path; it is never read (the adapter is loaded before any request
# names it, and the one id stays registered: max_cpu_loras = max_loras = 1). Were vLLM to
# look it up anyway, it fails on this path instead of loading something else.
ADAPTER_PATH = "/nonexistent/llamarl-in-memory-adapter"
_CHECKED = "vLLM 0.32.0"


def engine_lora_rank(rank: int) -> int:
    """vLLM's max_lora_rank for adapters of rank `rank`: the smallest rank vLLM's engine can
    be built for that is >= `rank` (config.VLLM_LORA_RANKS; config.py refuses larger)."""
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"model.lora.rank {rank}: vLLM runs adapters of rank <= "
                         f"{VLLM_LORA_RANKS[-1]}")
    return fitting[0]


def check_vllm_ranks() -> None:
    """The ranks config.VLLM_LORA_RANKS assumes are those the installed vLLM accepts."""
    import typing

    from vllm.config.lora import MaxLoRARanks

    if tuple(typing.get_args(MaxLoRARanks)) != VLLM_LORA_RANKS:
        raise RuntimeError(f"this vLLM's max_lora_rank choices {typing.get_args(MaxLoRARanks)} "
                           f"are not {VLLM_LORA_RANKS} (config.VLLM_LORA_RANKS, from "
                           f"{_CHECKED}): update that list")


def engine_lora_args(rank: int, max_loras: int = 1) -> dict:
    """The vLLM engine arguments for adapters of rank `rank`, `max_loras` resident at once
    (the recipe loop's engine: one; vLLM keeps as many in CPU memory)."""
    check_vllm_ranks()
    return {"enable_lora": True, "max_lora_rank": engine_lora_rank(rank),
            "max_loras": max_loras}


def lora_request():
    """The LoRARequest every generation request carries once the adapter is loaded."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(ADAPTER_NAME, ADAPTER_ID, ADAPTER_PATH)


def adapter_config(lora) -> dict:
    """PEFT's adapter_config.json fields that vLLM's PEFTHelper reads, for `lora` (a
    config.LoraConfig): rank, alpha, target modules."""
    return {"r": lora.rank, "lora_alpha": lora.alpha,
            "target_modules": list(lora.target_modules), "bias": "none"}


def _private(obj, name: str, what: str):
    """`obj.name`, or a one-line error saying which vLLM name is missing."""
    if not hasattr(obj, name):
        raise RuntimeError(f"model.lora.sync adapters: this vLLM has no {what}.{name}, which "
                           f"llamarl uses to refresh the engine's adapter in memory (checked "
                           f"against {_CHECKED}): install that vLLM, or set "
                           "model.lora.sync=merged")
    return getattr(obj, name)


class EngineAdapter:
    """The engine's one LoRA adapter, refreshed from each weight sync. Built in the vLLM
    worker (worker_ext), where the model runs; WeightReceiver hands it every sync through
    `load_weights`, as it would hand an engine's model the full weights.

    `config`: adapter_config (r, alpha, target modules); `names`: the tensors every sync
    brings (A and B of each adapted linear, PEFT's names)."""

    def __init__(self, worker, config: dict, names: Iterable[str], device: torch.device):
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.utils import parse_fine_tuned_lora_name

        runner = worker.model_runner
        lora_manager = getattr(runner, "lora_manager", None)
        if lora_manager is None:
            raise RuntimeError("model.lora.sync adapters: the vLLM engine was built without "
                               "LoRA (enable_lora): its weight sync cannot load adapters")
        self.manager = _private(lora_manager, "_adapter_manager", "WorkerLoRAManager")
        for name in ("remove_adapter", "add_adapter", "activate_adapter", "lora_config",
                     "supported_lora_modules", "packed_modules_mapping", "model", "modules"):
            _private(self.manager, name, "LoRAModelManager")
        self._from_tensors = _private(LoRAModel, "from_lora_tensors", "LoRAModel")
        self.helper = PEFTHelper.from_dict(dict(config))
        self.helper.validate_legal(self.manager.lora_config)  # rank <= max_lora_rank, ...
        self.dtype = self.manager.lora_config.lora_dtype  # the engine's dtype ("auto")
        self.device = device
        # As vLLM's own loader (WorkerLoRAManager._load_adapter): its name mapper and the
        # prefixes it skips
        model = self.manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        self.mapper = mapper.get_rename_mapper() if mapper is not None else None
        self.skip = getattr(model, "lora_skip_prefixes", None)
        # Every adapted module must be one the engine adapts: vLLM's directory loader checks
        # this (from_local_checkpoint), from_lora_tensors does not, and an adapter of a module
        # it does not know would be dropped silently.
        expected = set()
        for module in self.manager.supported_lora_modules:
            expected.update(self.manager.packed_modules_mapping.get(module, [module]))
        self.names = sorted(names)
        for name in self.names:
            module, _ = parse_fine_tuned_lora_name(name, self.mapper)
            if module.rsplit(".", 1)[-1] not in expected:
                raise ValueError(f"model.lora.target_modules: the engine's model has no LoRA "
                                 f"layer for {module} (it adapts {sorted(expected)})")
        self.loads = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Replace the engine's adapter with these tensors ((name, full tensor) pairs: A and
        B of every adapted linear); returns the names taken. The tensors are copied: they
        may be the receive buffers, which the next sync overwrites, and vLLM scales B in
        place."""
        tensors = {name: t.clone() for name, t in weights}
        if sorted(tensors) != self.names:
            missing = sorted(set(self.names) - set(tensors))
            raise RuntimeError(f"weight sync: {len(missing)} adapter tensor(s) missing "
                               f"({', '.join(missing[:3])})")
        lora = self._from_tensors(ADAPTER_ID, tensors, self.helper, device=self.device,
                                  dtype=self.dtype, weights_mapper=self.mapper,
                                  skip_prefixes=self.skip)
        # Between two engine steps (the engine's loop, or continuous mode's swap_weights):
        # nothing runs on the adapter while it is swapped. remove_adapter deactivates it
        # (frees its slot); add_adapter scales B and packs q/k/v, gate/up; activate_adapter
        # copies A and B into the stacked buffers that the LoRA kernels read.
        self.manager.remove_adapter(ADAPTER_ID)
        self.manager.add_adapter(lora)
        self.manager.activate_adapter(ADAPTER_ID)
        self.loads += 1
        return set(tensors)

    def checksum(self) -> float:
        """Sum of the adapter buffers of every LoRA layer (tests: the adapter changed)."""
        total = 0.0
        for module in self.manager.modules.values():
            for stacked in (*getattr(module, "lora_a_stacked", ()),
                            *getattr(module, "lora_b_stacked", ())):
                total += float(stacked.double().sum())
        return total
