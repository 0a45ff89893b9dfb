"""PPO's critic: a value model V(prefix) on the trainer sub-mesh, with its own optimizer.

The value model is a Hugging Face token-classification model with one label: the policy's
transformer (or a separate checkpoint's, e.g. a reward model's) and a linear value head `score`
on every position's last hidden state. It is FSDP2-sharded on the trainer mesh like the policy.

Alignment with trainer.policy.TokenBatch: the [B, T-1] value tensor holds at position t the
value of the prefix ending at token t, the state in which token t+1 is chosen. So V_t lines up
with the policy's logprob of token t+1 and with the loss mask.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from llamarl.config import Config
from llamarl.trainer.policy import (
    DTYPES,
    TokenBatch,
    model_inputs,
    scored,
    shard_for_training,
    to_padded,
)
from llamarl.trainer.step import PolicyTrainer


def load_critic(path: str, dtype: str, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """The value model from `path` (a causal LM's or a classifier's directory). A value head
    that the checkpoint does not have starts at zero, so the first values are 0 and the first
    advantages are the plain (KL-shaped) returns rather than noise from a random head."""
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    from llamarl.trainer.varlen_attention import implementation

    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0  # a value regression: no dropout on the head's input
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the new head is expected: no "newly initialized" report
    try:
        model, info = AutoModelForTokenClassification.from_pretrained(
            path, config=config, dtype=DTYPES[dtype], output_loading_info=True,
            attn_implementation=implementation(attn_implementation))
    finally:
        hf_logging.set_verbosity(level)
    model.config.use_cache = False
    missing = set(info["missing_keys"])
    with torch.no_grad():
        for name, param in model.score.named_parameters():
            if f"score.{name}" in missing:
                param.zero_()
    return model


def values(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    """V_t for every position that chooses a next token: [B, T-1] float32 (0 where nothing is
    scored when `batch` is packed)."""
    out = model(**model_inputs(batch)).logits
    return to_padded(batch, scored(batch, out)[..., 0].float())


def _forward(model: torch.nn.Module, batch: TokenBatch):
    return values(model, batch), None


# FSDP2 notes once that the root module returned a view; the values are only read out of place.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP\w+ForTokenClassification")


def build_critic(cfg: Config, policy_path: str, mesh, device: torch.device,
                 total_optimizer_steps: int, dp_size: int) -> PolicyTrainer:
    """The critic's trainer (model + AdamW + schedule), sharded on the trainer mesh."""
    model = load_critic(cfg.critic.path or policy_path, cfg.trainer.master_dtype,
                        cfg.model.attn_implementation).to(device)
    shard_for_training(model, mesh, cfg.trainer, DTYPES[cfg.model.dtype])
    c = cfg.critic
    tcfg = dataclasses.replace(cfg.trainer, lr=c.lr, weight_decay=c.weight_decay,
                               warmup_steps=c.warmup_steps, grad_clip=c.grad_clip)
    return PolicyTrainer(model, tcfg, total_optimizer_steps, dp_size, device, forward=_forward,
                         name="critic")


def critic_metrics(stats: dict) -> dict:
    """The critic's entries of the metrics row, from the update's sums (rl_step): its loss and
    gradient norm, its mean value per sampled token and the share of values clipped
    (critic.value_clip)."""
    n_tok = max(stats["n_tokens"], 1.0)
    return {"value_loss": stats["value_loss"], "critic_grad_norm": stats["critic_grad_norm"],
            "value_mean": stats["value_sum"] / n_tok,
            "value_clip_frac": stats["value_clipped"] / n_tok}
