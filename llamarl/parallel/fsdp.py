"""FSDP2 sharding of Hugging Face causal LMs on the trainer sub-mesh (torchtitan style):
`fully_shard` each decoder block, then the root (embeddings, final norm, lm_head)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of a HF causal LM (Llama/Qwen2/Mistral/... layout)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers: llamarl shards HF decoder "
                         "models whose blocks live in model.model.layers (Llama, Qwen2, Mistral)")
    return list(layers)


def apply_fsdp(model: torch.nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype = torch.float32,
               gradient_checkpointing: bool = False) -> torch.nn.Module:
    """Shard `model` in place over `mesh` (1-D, the trainer data-parallel ranks); with
    `gradient_checkpointing`, each block's activations are recomputed in backward (HF's
    non-reentrant checkpointing, which composes with FSDP2's hooks)."""
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = decoder_blocks(model)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed right away by the root's backward: keep them.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model
