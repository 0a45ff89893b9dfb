"""Which precision TRL 1.16's GRPOTrainer samples in, with `bf16=True` on a CPU.

A forward hook on SmolLM2's first q_proj records, for every call of one training step, whether
gradients were on (off: `generate`; on: the loss's forward), the output's dtype and whether
CPU autocast was active. Accelerate wraps the prepared model's forward in autocast and
`unwrap_model` keeps that wrapper, so TRL's `generate` runs under autocast too: bfloat16
products over float32 weights, as its update does (docs/measured/smollm2_vs_trl.md).

    python bench/trl_generation_dtype.py    # needs trl==1.16.0 (pip install -e .[bench])
"""

from __future__ import annotations

import collections
import tempfile

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from llamarl.models.smollm2 import ensure_smollm2


def main() -> None:
    path = str(ensure_smollm2("135m-instruct"))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    seen: collections.Counter = collections.Counter()

    def hook(module, inputs, output):
        seen[("loss forward" if torch.is_grad_enabled() else "generate", str(output.dtype),
              "autocast" if torch.is_autocast_enabled("cpu") else "no autocast")] += 1

    model.model.layers[0].self_attn.q_proj.register_forward_hook(hook)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 13?"}],
                                     tokenize=False, add_generation_prompt=True)
    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(), max_steps=1, per_device_train_batch_size=8,
                     gradient_accumulation_steps=1, num_generations=8, max_completion_length=4,
                     use_cpu=True, bf16=True, report_to="none", save_strategy="no", top_k=0,
                     disable_tqdm=True)
    trainer = GRPOTrainer(model=model, args=cfg, processing_class=tok,
                          reward_funcs=lambda completions, **_: [float(i % 2) for i in
                                                                 range(len(completions))],
                          train_dataset=Dataset.from_list([{"prompt": prompt}] * 16))
    trainer.train()
    for (phase, dtype, autocast), n in sorted(seen.items()):
        print(f"{phase}: q_proj output {dtype}, {autocast} ({n} calls)")


if __name__ == "__main__":
    main()
