"""A saved LoRA adapter merged into the base weights, for an engine that samples with merged
weights instead of vLLM's LoRA layers (service.sampling_lora: merged; docs/service.md).

Why: on a CPU, vLLM 0.32's LoRA layers (the punica wrapper's torch ops) gather every token's
adapter matrices in every layer, and sampling with an adapter ran 7-9x slower than the base
(bench/results/service_sampling_cpu.json). Merged, a request costs what a base request does; the
price is one load of the adapted modules' weights when the engine switches adapter.

The maths, per adapted module with base weight W [out, in], A [r, in], B [out, r] (PEFT's
lora_A / lora_B) and scale s = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA):

    W' = W + s * B @ A

computed in float32 and cast to the engine's dtype (what PEFT's merge_and_unload does for a
float32 base; with a bfloat16 engine the sum is rounded once, as the recipe loop's merged
weight syncs are: docs/trainer.md, LoRA).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ADAPTER_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def adapter_key(directory: Path | None) -> tuple | None:
    """What identifies an adapter's contents: its directory and its file's modification time
    (a name saved again holds new weights), or None for the base."""
    if directory is None:
        return None
    directory = Path(directory).resolve()
    try:
        return (str(directory), (directory / ADAPTER_FILE).stat().st_mtime_ns)
    except FileNotFoundError:
        raise ValueError(f"the sampler weights in {directory} are gone: save them again "
                         "(save_weights_for_sampler)") from None


def adapter_deltas(directory: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """{base weight name: (A [r, in], B [out, r], scale)} of the PEFT adapter in `directory`
    (adapter_config.json + adapter_model.safetensors, as save_weights_for_sampler writes)."""
    from safetensors.torch import load_file

    config = json.loads((Path(directory) / "adapter_config.json").read_text())
    rank = int(config["r"])
    scale = float(config["lora_alpha"]) / (rank ** 0.5 if config.get("use_rslora") else rank)
    tensors = load_file(str(Path(directory) / ADAPTER_FILE))
    deltas = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[:-len(".lora_A.weight")].removeprefix(PEFT_PREFIX)
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        assert a.shape[0] == b.shape[1] == rank, (key, a.shape, b.shape, rank)
        deltas[f"{module}.weight"] = (a, b, scale)
    return deltas


class BaseWeights:
    """The base checkpoint's tensors by name, read from its safetensors files on demand (no
    copy held: the page cache keeps what is read often)."""

    def __init__(self, model_dir: str):
        from safetensors import safe_open

        self._files: dict[str, Path] = {}
        for file in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                self._files.update({name: file for name in f.keys()})
        if not self._files:
            raise ValueError(f"{model_dir} holds no .safetensors files: merged sampling reads "
                             "the base weights from them (service.sampling_lora: adapters "
                             "does not)")

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self._files:
            raise KeyError(f"the base checkpoint has no {name!r}: the adapter was trained on "
                           "another model")
        with safe_open(str(self._files[name]), framework="pt") as f:
            return f.get_tensor(name)


def merged_weights(base: BaseWeights, deltas: dict, names: set[str], dtype: torch.dtype):
    """(name, W') for every name in `names`: the base weight plus the adapter's delta where
    `deltas` has one, the base weight itself where not (restoring a module that the previous
    adapter changed)."""
    for name in sorted(names):
        weight = base.get(name)
        if name in deltas:
            a, b, scale = deltas[name]
            weight = weight.float() + scale * (b.float() @ a.float())
        yield name, weight.to(dtype)
