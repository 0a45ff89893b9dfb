"""LoRA on the policy (PEFT): adapters injected into the Hugging Face model in place, the
reference policy as the same module with its adapters off, and the merged weights that the
engines and the exported policy get (model.lora, docs/trainer.md: LoRA).

Each target linear layer keeps its weight W [out, in] frozen and adds a low-rank update:

    y = W x + s * B (A drop(x)),   A [r, in], B [out, r], s = alpha / r

PEFT initialises A (Kaiming-uniform) and B = 0, so the policy starts as the base model. The
adapters are injected before FSDP2 shards the model (`add_adapters`), so every parameter, base
or adapter, is sharded along dim 0 like any other; only A and B require gradients, and only
they get optimizer state (trainer/optim.py takes the trainable parameters). Names change:
`...q_proj.weight` becomes `...q_proj.base_layer.weight`, beside
`...q_proj.lora_A.default.weight` and `...q_proj.lora_B.default.weight`.

The engines run the base architecture, so they get the merged weight under the base name
(`engine_name`):

    W' = W + s * B @ A                     [out, in]

and since FSDP2 shards W and B by the same rows (dim 0 of equal size, split like torch.chunk),
trainer rank k computes its rows of W' from what it holds and A whole (r x in, small):

    W'[rows_k] = W[rows_k] + s * B[rows_k] @ A          (`merged_shard`)

so the weight sync keeps the layout of the base weights: same metas, same buckets, same bytes.

`model.lora.modules_to_save` (PEFT's key: RMSNorm layers only) trains whole copies of some
small modules beside the adapters, as PEFT's ModulesToSaveWrapper does: `model.norm` becomes
`model.norm.original_module` (frozen; what the reference runs) and
`model.norm.modules_to_save.default` (trained, in the optimizer, checkpointed; what the
policy runs and what the engines get under the base name, `model.norm.weight`). Why: with the
tied embeddings E frozen, the logits E (g * h / rms(h)) are bounded by the final norm's
weight g, and on the tiny model no hidden state the adapters can produce gives a token more
than 0.80-0.88 of the probability (docs/trainer.md: LoRA).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from llamarl.parallel.adapters import (
    ADAPTER,
    adapter_name,
    engine_name,
    full_of,
    is_adapter,
    is_trainable,
    lora_layers,
    merged_layers,
    sent_in_full,
)


def add_adapters(model: torch.nn.Module, lora, seed: int) -> torch.nn.Module:
    """Inject LoRA adapters (`lora`: config.LoraConfig) into `model` in place, before FSDP2,
    and freeze everything else. A's initialisation draws from its own generator seeded with
    `seed`, so every trainer rank starts from the same adapters (FSDP2 shards each rank's
    copy as if they were equal) and the global RNG stream is left as it was."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                            target_modules=list(lora.target_modules), bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    _wrap_modules_to_save(model, getattr(lora, "modules_to_save", ()))
    for name, p in model.named_parameters():
        p.requires_grad_(is_trainable(name))
    for layer in lora_layers(model):
        if not isinstance(layer.base_layer, torch.nn.Linear):
            raise ValueError(f"model.lora.target_modules: {type(layer.base_layer).__name__} "
                             "layers are not supported: target the decoder's linear layers")
    return model


def modules_to_save_paths(model: torch.nn.Module, names) -> list[str]:
    """The paths of the modules whose last name component is in `names` (`norm` ->
    `model.norm`, not `...input_layernorm`). PEFT matches modules_to_save by plain suffix
    (`input_layernorm` ends with `norm`), so its config gets these full paths."""
    paths = []
    for wanted in names:
        found = [n for n, _ in model.named_modules() if n.split(".")[-1] == wanted]
        if not found:
            raise ValueError(f"model.lora.modules_to_save: the model has no module named "
                             f"{wanted!r}: use the name of one of its RMSNorm layers "
                             f"(norm, input_layernorm, post_attention_layernorm)")
        paths += found
    return paths


def _wrap_modules_to_save(model: torch.nn.Module, names) -> None:
    """Replace every module named in `names` (modules_to_save_paths) by PEFT's
    ModulesToSaveWrapper (the original, frozen, and a trained copy of it), as PeftModel does
    for `modules_to_save`, so that the names are PEFT's and its save_pretrained / from_pretrained
    read them."""
    from peft.utils import ModulesToSaveWrapper

    for path in modules_to_save_paths(model, names):
        parent_name, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, ModulesToSaveWrapper(model.get_submodule(path), ADAPTER))


def store_frozen_in(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Keep the frozen base's floating-point parameters in `dtype` (model.dtype, the compute
    dtype) instead of the master dtype; returns the bytes saved. Nothing but the adapters is
    updated, and FSDP2 casts every parameter to model.dtype for each forward anyway
    (MixedPrecisionPolicy.param_dtype), so the forward and backward compute the same values;
    a float32 copy of the base only cost memory (4 bytes a weight instead of 2 in bfloat16).
    The merged weights (syncs, export) are still computed in float32: W + s B A with W as
    stored."""
    saved = 0
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            saved += p.numel() * (p.element_size() - torch.empty((), dtype=dtype).element_size())
            p.data = p.data.to(dtype)
    return saved


def peft_config(lora, base_model_path: str = "", modules_to_save: list[str] = ()):
    """PEFT's LoraConfig for a config.LoraConfig (or its dict in a checkpoint's meta.json);
    `modules_to_save`: the full paths of its modules_to_save (modules_to_save_paths)."""
    from peft import LoraConfig as PeftLoraConfig

    get = lora.get if isinstance(lora, dict) else lambda k: getattr(lora, k)
    return PeftLoraConfig(r=get("rank"), lora_alpha=get("alpha"), lora_dropout=get("dropout"),
                          target_modules=list(get("target_modules")), bias="none",
                          modules_to_save=list(modules_to_save) or None,
                          base_model_name_or_path=base_model_path or None)


def has_adapters(model) -> bool:
    return bool(lora_layers(model))


@contextmanager
def adapters_off(model: torch.nn.Module):
    """Run `model` as the base model: every LoRA layer computes W x alone (the flag that
    PEFT's forward reads, BaseTunerLayer.disable_adapters). Not PEFT's switch,
    enable_adapters(False) / PeftModel.disable_adapter: it also sets requires_grad of the
    adapter parameters registered at that moment, and under FSDP2 a block that keeps its
    gathered parameters after forward (the last one) has its unsharded ones registered.
    Seen with it: after a reference forward, a checkpoint left out the last block's adapters
    as frozen (tests/test_lora.py runs the reference before the update, then resumes)."""
    from peft.utils import ModulesToSaveWrapper

    # LoRA layers compute W x alone; a module_to_save's wrapper runs its original
    layers = lora_layers(model) + [m for m in model.modules()
                                   if isinstance(m, ModulesToSaveWrapper)]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield model
    finally:
        for layer in layers:
            layer._disable_adapters = False


class AdaptersOff:
    """The reference policy of a LoRA run: the policy module itself with its adapters off
    (the base model, no second copy of the weights). Called like the model; everything else
    (config, get_output_embeddings, ...) is the policy's."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        with adapters_off(self.model):
            return self.model(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights of the adapted model as the base model's state dict: W' = W + s B A
    for every adapted linear, the adapters left out, names without `.base_layer`, and each
    module_to_save's trained copy under the base name (a collective: gathers every tensor on
    every trainer rank)."""
    layers = {f"{n}.base_layer.weight": layer for n, layer in
              ((n[: -len(".weight")], layer) for n, layer in merged_layers(model).items())}
    out = {}
    for name, t in model.state_dict().items():
        if not sent_in_full(name):
            continue
        full = full_of(t).detach()
        layer = layers.get(name)
        if layer is not None:
            a = full_of(layer.lora_A[ADAPTER].weight).detach()
            b = full_of(layer.lora_B[ADAPTER].weight).detach().to(a.dtype)
            full = torch.addmm(full.to(a.dtype), b, a, alpha=layer.scaling[ADAPTER])
        out[engine_name(name)] = full
    return out


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' full tensors in PEFT's saved form (`adapter_name`), as `save_pretrained`
    writes them (a collective)."""
    return {adapter_name(name): full_of(t).detach()
            for name, t in model.state_dict().items() if is_adapter(name)}


def trainable_count(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, all) parameter counts of the full (unsharded) model."""
    params = list(model.parameters())
    return (sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params))


def export_lora(lora: dict, base_path: str, adapters: dict[str, torch.Tensor]):
    """A LoRA checkpoint's adapters (`lora`: its config as meta.json holds it; `adapters`:
    their full tensors by the trainer's names) on the base model at `base_path`. Returns the
    merged model's state dict (the base model's names, W + s B A: `merged_state_dict`) and
    the PeftModel holding the adapters (its save_pretrained writes a PEFT adapter
    directory)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    # (modules_to_save is absent from the meta of checkpoints written before it existed)
    saved = modules_to_save_paths(base, lora.get("modules_to_save", ()))
    peft_model = get_peft_model(base, peft_config(lora, base_path, saved), adapter_name=ADAPTER)
    own = {name for name in peft_model.state_dict() if is_trainable(name)}
    given = {"base_model.model." + name: t for name, t in adapters.items()
             if is_trainable(name)}
    if set(given) != own:
        raise ValueError(f"the checkpoint's adapters do not fit {base_path} with model.lora "
                         f"{lora}: {len(given)} adapter tensors for {len(own)}")
    missing, unexpected = peft_model.load_state_dict(given, strict=False)
    assert not unexpected and not (set(given) & set(missing)), unexpected
    return merged_state_dict(peft_model.base_model.model), peft_model
