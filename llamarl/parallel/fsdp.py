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


def trainer_options(trainer) -> dict:
    """apply_fsdp's keyword arguments from the recipe's `trainer` section (a TrainerConfig),
    for the models the RL update trains: the policy and the critic."""
    return {"gradient_checkpointing": trainer.gradient_checkpointing,
            "compile": trainer.compile,
            "activation_memory_budget": trainer.activation_memory_budget}


def apply_fsdp(model: torch.nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype = torch.float32,
               gradient_checkpointing: bool = False, compile: bool = False,
               activation_memory_budget: float = 1.0) -> torch.nn.Module:
    """Shard `model` in place over `mesh` (1-D, the trainer data-parallel ranks); with
    `gradient_checkpointing`, each block's activations are recomputed in backward (HF's
    non-reentrant checkpointing, which composes with FSDP2's hooks); with `compile`, each
    block's forward is compiled by torch.compile before it is sharded (torchtitan's order:
    FSDP2's hooks stay outside the compiled region), which fuses the norms', rotary
    embedding's and MLP's elementwise work; sequence lengths vary, so shapes are dynamic.
    `activation_memory_budget` < 1 (with `compile`) has the compiler's partitioner keep at most
    that share of each block's activations for backward and recompute the cheapest of the
    rest (torch._functorch.config.activation_memory_budget: process-wide, read when a block
    compiles; every model this process compiles is a trainer model)."""
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = decoder_blocks(model)
    if compile:
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = activation_memory_budget
    for i, block in enumerate(blocks):
        if compile:
            block.compile(dynamic=True)
        fully_shard(block, mesh=mesh, mp_policy=mp,
                    reshard_after_forward=_reshards_after_forward(i, len(blocks)))
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _reshards_after_forward(i: int, blocks: int) -> bool:
    """Block i frees its all-gathered parameters after forward (and gathers them again for
    backward), except the last: its parameters are needed right away by the root's backward."""
    return i < blocks - 1


def hold_gathered(model: torch.nn.Module, hold: bool) -> None:
    """trainer.keep_gathered_params: with `hold`, every block of the sharded `model` keeps its
    all-gathered parameters after its forward (PolicyTrainer.step also keeps them after each
    backward but the step's last), so each block is gathered once per step instead of twice
    per micro-batch; without, apply_fsdp's settings again (after forward, and after backward
    for every module)."""
    blocks = decoder_blocks(model)
    for i, block in enumerate(blocks):
        block.set_reshard_after_forward(not hold and _reshards_after_forward(i, len(blocks)),
                                        recurse=False)
    if not hold:
        model.set_reshard_after_backward(True)


def place_shards(model: torch.nn.Module, destinations: dict[str, torch.Tensor]) -> set[str]:
    """Move the local FSDP2 shard of each parameter named in `destinations` (a checkpoint
    name: the first name of a tied parameter) into the memory of its destination, a
    contiguous tensor of the shard's shape and dtype, e.g. a slot of a weight-sync send buffer:
    from then on FSDP2's all-gathers, the optimizer's in-place steps and a reader of the
    destination all see one tensor, so the weight sync sends it without a copy. Returns the
    names moved.

    Moved: shards without padding (FSDP2 pads the last ranks' shards of a dim-0 size that the
    ranks do not divide) and not offloaded. FSDP2 keeps each shard twice over one storage
    (FSDPParam._sharded_param_data, the all-gather input, and the DTensor's _local_tensor, the
    parameter): both are re-pointed with Tensor.set_. If FSDP2 replaces the storage later
    (load_state_dict(assign=True), module.to()), the shard simply no longer lives in the
    destination: a reader must compare data_ptr() before relying on it (WeightSender does).
    """
    from torch.distributed.fsdp import FSDPModule

    names = {id(p): n for n, p in model.named_parameters()}  # first name of a tied one
    moved = set()
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            group = module._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else ():
                name = names.get(id(fsdp_param.sharded_param))
                dest = destinations.get(name)
                local = fsdp_param.sharded_param._local_tensor
                flat = fsdp_param._sharded_param_data
                if (dest is None or fsdp_param.offload_to_cpu or not dest.is_contiguous()
                        or dest.shape != local.shape or dest.dtype != local.dtype
                        or dest.device != local.device or flat.numel() != local.numel()
                        or local.numel() == 0):
                    continue
                dest.copy_(local)
                storage, offset = dest.untyped_storage(), dest.storage_offset()
                flat.set_(storage, offset, (local.numel(),), (1,))
                local.set_(storage, offset, dest.shape, dest.stride())
                moved.add(name)
    return moved
