"""The embedded tiny policy: a real Qwen2 architecture and a real character-level tokenizer.

Built in code so that tests and `make run` need no download. Sizes respect vLLM's CPU kernels
(head_dim 32). The tokenizer is a `tokenizers` WordLevel model over single characters, wrapped as
a Hugging Face fast tokenizer, so transformers and vLLM both load the saved directory unchanged.
"""

from __future__ import annotations

from pathlib import Path

from llamarl.tiny.task import ALPHABET, SEPARATOR

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]


def build_tokenizer(chars: list[str] | None = None):
    """A character-level tokenizer: the special tokens, then one id per character of `chars`
    (default: the tiny task's alphabet, separator, space, digits and +-*), in that order."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if chars is None:
        chars = list(ALPHABET) + [SEPARATOR, " "] + [str(d) for d in range(10)] + list("+-*")
    vocab = {tok: i for i, tok in enumerate(SPECIAL + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", clean_up_tokenization_spaces=False)


def build_config(vocab_size: int):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, torch_dtype="float32")


def build_model(seed: int = 0):
    """A freshly initialised tiny Qwen2ForCausalLM and its tokenizer."""
    import torch
    from transformers import Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(build_config(len(tokenizer)))
    return model, tokenizer


def save_hf_dir(path: Path, state_dict: dict, config, tokenizer) -> None:
    """Write a Hugging Face directory (safetensors + config + tokenizer) atomically."""
    import os
    import shutil
    import tempfile

    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)  # tied: stored once, as HF does
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
