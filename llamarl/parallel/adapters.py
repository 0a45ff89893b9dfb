"""What the weight sync needs to know of a LoRA policy (PEFT, trainer/lora.py): PEFT's
parameter names (which are adapters, which go to the engines as full weights, under which
names), and how one adapted linear's rows merge, W' = W + s B A. Below the trainer, so the
sender (parallel/weight_sender.py, weight_plan.py) and trainer/lora.py share one copy.
"""

from __future__ import annotations

import torch

ADAPTER = "default"  # PEFT's adapter name
TRAINED_COPY = f".modules_to_save.{ADAPTER}."  # a module_to_save's trained copy
FROZEN_ORIGINAL = ".original_module."  # ... and the original beside it (the reference's)


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is a LoRA adapter matrix (A or B)."""
    return ".lora_A." in name or ".lora_B." in name


def is_trained_copy(name: str) -> bool:
    """Whether `name` is in a module_to_save's trained copy (model.lora.modules_to_save)."""
    return TRAINED_COPY in name


def is_frozen_original(name: str) -> bool:
    """Whether `name` is in the frozen original of a module_to_save: the reference's, never
    sent (the engines get the trained copy under the base name) nor checkpointed."""
    return FROZEN_ORIGINAL in name


def is_trainable(name: str) -> bool:
    """Whether parameter `name` of a LoRA policy is trained (and checkpointed): an adapter
    matrix or a module_to_save's copy."""
    return is_adapter(name) or is_trained_copy(name)


def engine_name(name: str) -> str:
    """The base model's name of a tensor of the adapted model: `.base_layer` dropped, and a
    module_to_save's trained copy under the original's name (`model.norm.weight`)."""
    return name.replace(".base_layer.", ".").replace(TRAINED_COPY, ".")


def sent_in_full(name: str) -> bool:
    """Whether tensor `name` of a policy goes to the engines as a full weight (merged syncs,
    export): everything but the adapter matrices (merged into their base weights) and the
    frozen originals of modules_to_save (their trained copies go instead)."""
    return not is_adapter(name) and not is_frozen_original(name)


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def full_of(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def merged_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Engine weight name (`...q_proj.weight`) -> its LoRA layer, for every adapted linear."""
    names = {id(m): n for n, m in model.named_modules()}
    return {f"{names[id(layer)]}.weight": layer for layer in lora_layers(model)}


def merged_shard(layer: torch.nn.Module) -> torch.Tensor:
    """This trainer rank's rows of W' = W + s * B @ A for one LoRA layer, [rows, in] in the
    adapters' (master) dtype: W[rows] + s * B[rows] @ A, A gathered whole (a collective over
    the trainer ranks: every rank calls this for the same layers in the same order), computed
    in that dtype whatever W is stored in (store_frozen_in). Without FSDP2 the whole W'."""
    w = layer.base_layer.weight
    a = full_of(layer.lora_A[ADAPTER].weight).detach()
    b = local_of(layer.lora_B[ADAPTER].weight).detach()
    w_local = local_of(w).detach()
    assert b.shape[0] == w_local.shape[0], "FSDP2 splits W and B by the same rows"
    return torch.addmm(w_local.to(a.dtype), b.to(a.dtype), a, alpha=layer.scaling[ADAPTER])


def adapter_name(name: str) -> str:
    """An adapter parameter's name in PEFT's saved form, as `save_pretrained` writes it and
    vLLM's LoRA loader reads it: `base_model.model.<name>` without the adapter name
    (`...q_proj.lora_A.default.weight` -> `base_model.model....q_proj.lora_A.weight`)."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The PEFT LoRA layers of `model`, in module order (empty: no adapters)."""
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]
