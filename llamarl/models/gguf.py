"""A GGUF checkpoint as a float32 Hugging Face directory that the trainer and vLLM both load.

transformers reads GGUF files (`from_pretrained(dir, gguf_file=name)`, with the `gguf`
package): it dequantises every tensor (Q4_1 block of 32 weights: w_i = d * q_i + m, q_i in
0..15; Q8_0: w_i = d * q_i) into the model's dtype, undoes llama.cpp's permutation of the
query and key rows, and rebuilds the tokenizer (tokens, merges, special ids, chat template)
from the file's metadata. It keeps a `quantization_config` (quant_method gguf) in the config,
so `save_pretrained` refuses the model; written here instead:

    model.safetensors   the dequantised state dict in float32 (a tied lm_head stored once,
                        as model.embed_tokens.weight, tiny/model.save_hf_dir)
    config.json         the model's config without quantization_config, dtype float32
    tokenizer files     the rebuilt tokenizer, its chat template included

The float32 weights are the GGUF's values exactly (a 4-bit code times a float16 scale plus a
float16 offset is exact in float32); the directory is written atomically.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write `gguf_path` (a GGUF file of an architecture transformers reads) to `out_dir` as a
    float32 Hugging Face directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llamarl.tiny.model import save_hf_dir

    gguf_path = Path(gguf_path)
    where, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    with _no_tensor_progress_bar():
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights written are plain float32
    config.dtype = torch.float32
    if tokenizer.pad_token_id is None:  # (a GGUF may name no padding token)
        tokenizer.pad_token = tokenizer.eos_token
    config.pad_token_id = tokenizer.pad_token_id
    state = {k: v.detach().to(torch.float32) for k, v in model.state_dict().items()}
    save_hf_dir(Path(out_dir), state, config, tokenizer)


@contextlib.contextmanager
def _no_tensor_progress_bar():
    """transformers draws a carriage-return progress bar over the GGUF's tensors ("Converting
    and de-quantizing GGUF tensors...", a second or two): in a rank's log, one line of 15
    redraws. The caller's own line (models/smollm2.py: "converting ...") says what happens,
    so the bar is drawn disabled; a transformers without that module attribute is left as
    it is."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar
