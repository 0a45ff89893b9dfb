"""models/gguf.py: a GGUF file, written here with the `gguf` package the way llama.cpp writes a
Llama checkpoint (query/key rows permuted, linear layers Q4_1, embedding Q8_0, tied output,
a byte-level BPE tokenizer with a ChatML template), converts into a float32 Hugging Face
directory holding exactly the file's dequantised values in Hugging Face's layout."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt "
          "%}{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_level_vocab() -> tuple[list[str], list[str]]:
    """GPT-2's byte-to-unicode alphabet plus two merges (tokens, merges)."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["Ġ t", "h e"]
    return SPECIAL + alphabet + [m.replace(" ", "") for m in merges], merges


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of query/key rows (rotary halves
    interleaved)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(path, vocab: int, tokens: list[str], merges: list[str]) -> dict[str, np.ndarray]:
    """A random tiny Llama as llama.cpp writes it; returns the Hugging Face state dict the
    file stands for (its dequantised values, query/key rows un-permuted)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    expected: dict[str, np.ndarray] = {}

    def put(name: str, hf: str, shape: tuple, qtype=Q.F32, heads: int = 0) -> None:
        value = rng.normal(0, 0.05, shape).astype(np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, value)
            stored = value
        else:
            packed = gguf.quants.quantize(value, qtype)
            w.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)
            stored = gguf.quants.dequantize(packed, qtype)
        expected[hf] = unpermute(stored, heads) if heads else stored

    put("token_embd.weight", "model.embed_tokens.weight", (vocab, HIDDEN), Q.Q8_0)
    for i in range(LAYERS):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        put(b + "attn_norm.weight", h + "input_layernorm.weight", (HIDDEN,))
        # written permuted, as llama.cpp does; the state dict holds the un-permuted rows
        q = rng.normal(0, 0.05, (HIDDEN, HIDDEN)).astype(np.float32)
        k = rng.normal(0, 0.05, (KV_HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
        for name, hf, value, heads in (("attn_q", "self_attn.q_proj", q, HEADS),
                                       ("attn_k", "self_attn.k_proj", k, KV_HEADS)):
            packed = gguf.quants.quantize(permute(value, heads), Q.Q4_1)
            w.add_tensor(b + name + ".weight", packed, raw_shape=packed.shape, raw_dtype=Q.Q4_1)
            expected[h + hf + ".weight"] = unpermute(gguf.quants.dequantize(packed, Q.Q4_1),
                                                     heads)
        put(b + "attn_v.weight", h + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN),
            Q.Q4_1)
        put(b + "attn_output.weight", h + "self_attn.o_proj.weight", (HIDDEN, HIDDEN), Q.Q4_1)
        put(b + "ffn_norm.weight", h + "post_attention_layernorm.weight", (HIDDEN,))
        put(b + "ffn_gate.weight", h + "mlp.gate_proj.weight", (FFN, HIDDEN), Q.Q4_1)
        put(b + "ffn_up.weight", h + "mlp.up_proj.weight", (FFN, HIDDEN), Q.Q4_1)
        put(b + "ffn_down.weight", h + "mlp.down_proj.weight", (HIDDEN, FFN), Q.Q4_1)
    put("output_norm.weight", "model.norm.weight", (HIDDEN,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def test_a_gguf_file_round_trips_into_a_float32_hf_directory(tmp_path, capfd):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llamarl.models.gguf import convert_gguf

    tokens, merges = byte_level_vocab()
    expected = write_gguf(tmp_path / "tiny.Q4_1.gguf", len(tokens), tokens, merges)
    out = tmp_path / "converted"
    convert_gguf(tmp_path / "tiny.Q4_1.gguf", out)
    assert "de-quantizing" not in capfd.readouterr().err  # transformers' bar is not drawn

    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert config["tie_word_embeddings"] and config["model_type"] == "llama"
    assert config["num_key_value_heads"] == KV_HEADS and config["pad_token_id"] == 2
    saved = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in saved  # tied: stored once, as vLLM reads it
    assert set(saved) == set(expected)
    for name, value in expected.items():
        assert saved[name].dtype == torch.float32
        assert torch.equal(saved[name], torch.from_numpy(value)), name
    assert float(saved["model.layers.0.self_attn.q_proj.weight"].abs().sum()) > 0

    model = AutoModelForCausalLM.from_pretrained(out)  # loads as a plain float32 model
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == tok.eos_token_id == 2
    text = "the heat"
    assert tok.decode(tok.encode(text)) == text
    assert tok.convert_tokens_to_ids("Ġt") in tok.encode(" to")  # the merges survive
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
