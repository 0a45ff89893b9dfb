"""service/merged_lora.py: a saved adapter merged into the base weights equals PEFT's own
merge (merge_and_unload) of the same adapter, module by module; modules the adapter does not
touch come back as the base's; bad adapter directories are named."""

from __future__ import annotations

import pytest
import torch

from llamarl.service.merged_lora import (
    BaseWeights,
    adapter_deltas,
    adapter_key,
    merged_weights,
)


def _saved_adapter(model_dir, out, rank: int, targets: list[str], rslora: bool = False):
    """A PEFT adapter on the tiny model with random (nonzero) A and B, saved as PEFT saves it
    (what save_weights_for_sampler writes); -> the PEFT model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=32, target_modules=targets,
                                            use_rslora=rslora))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    peft.save_pretrained(out)
    return peft


@pytest.mark.parametrize("rslora", [False, True])
def test_merged_weights_equal_peft_merge(tiny_model_dir, tmp_path, rslora):
    peft = _saved_adapter(tiny_model_dir, tmp_path / "a", 4, ["q_proj", "v_proj", "down_proj"],
                          rslora)
    deltas = adapter_deltas(tmp_path / "a")
    assert sorted(deltas) == sorted(f"model.layers.{i}.{m}.weight" for i in range(2) for m in
                                    ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"))
    reference = peft.merge_and_unload().state_dict()
    base = BaseWeights(str(tiny_model_dir))
    other = "model.layers.0.self_attn.k_proj.weight"  # (not adapted: the base's own)
    got = dict(merged_weights(base, deltas, set(deltas) | {other}, torch.float32))
    assert set(got) == set(deltas) | {other}
    for name, weight in got.items():
        torch.testing.assert_close(weight, reference[name], rtol=0, atol=1e-6)
        assert (name == other) == torch.equal(weight, base.get(name))
    assert got["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32
    half = dict(merged_weights(base, deltas, {other}, torch.bfloat16))
    assert half[other].dtype == torch.bfloat16


def test_bad_adapter_directories_are_named(tiny_model_dir, tmp_path):
    assert adapter_key(None) is None
    with pytest.raises(ValueError, match="are gone: save them again"):
        adapter_key(tmp_path / "nothing")
    with pytest.raises(ValueError, match="no .safetensors files"):
        BaseWeights(str(tmp_path))
    with pytest.raises(KeyError, match="trained on another model"):
        BaseWeights(str(tiny_model_dir)).get("model.layers.9.mlp.up_proj.weight")
