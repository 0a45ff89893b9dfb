"""A frozen reward model: a Hugging Face `AutoModelForSequenceClassification` with one label,
scoring `prompt + completion` texts in batches.

Where it runs (reward.model_placement):
  * generator (this module's SequenceRewardModel, the default): on each generator rank, right
    after generation, next to the rule-based rewards. That is where the texts are (no extra
    transfer), the rewards are final when a rollout batch leaves the generator (dynamic sampling
    needs them), and each engine scores only its own samples. On GPU it shares the engine's GPU
    (it uses what `gpu_memory_utilization` leaves free); on CPU it runs on the generator's cores.
    Good for small reward models.
  * trainer (llamarl/trainer/reward_model.py): FSDP2-sharded over the trainer sub-mesh, for
    reward models too big to sit unsharded beside a vLLM engine.

Both load the model with `load_reward_model` (the same checks and the same context limit).

Scores: s_i = logit of the last real token of sequence i ([B, 1] -> [B]). Sequences are
tokenized with the reward model's own tokenizer (it need not be the policy's), sorted by length,
right-padded with the model's `pad_token_id` in batches of `batch_size`, so a batched score equals
the one-at-a-time score. Texts longer than the model's context keep their last tokens.
"""

from __future__ import annotations

from pathlib import Path


def load_reward_model(path: str, dtype="auto"):
    """The frozen (eval, no grad) classifier at `path` in `dtype`, its tokenizer, the pad id it
    batches with, and its context length (tokens). ValueError naming reward.model_path when the
    directory is not a one-label sequence classifier that can pad."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"reward.model_path {path!r} is not a Hugging Face model directory "
                         "(no config.json): point it at a saved sequence-classification "
                         "model")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
    if model.config.num_labels != 1:
        raise ValueError(f"reward.model_path {path!r} has num_labels = "
                         f"{model.config.num_labels}: a reward model needs exactly one "
                         "output (a scalar score)")
    pad = model.config.pad_token_id
    if pad is None:
        pad = tokenizer.pad_token_id
    if pad is None:
        raise ValueError(f"reward.model_path {path!r} defines no pad_token_id (config.json "
                         "or tokenizer): set one so that batches can be padded")
    model.config.pad_token_id = pad  # transformers finds each row's last real token by it
    model.config.use_cache = False
    limits = [getattr(model.config, "max_position_embeddings", None),
              getattr(tokenizer, "model_max_length", None)]
    max_len = min(x for x in limits + [1 << 20] if x)
    return model.eval().requires_grad_(False), tokenizer, pad, max_len


class SequenceRewardModel:
    def __init__(self, path: str, device: str = "cpu", batch_size: int = 32):
        import torch

        model, self.tokenizer, self.pad_id, self.max_len = load_reward_model(path)
        self.model = model.to(device)
        self.device = torch.device(device)
        self.batch_size = batch_size

    def score(self, texts: list[str]) -> list[float]:
        """One scalar per text ([B] floats), in the order given."""
        import torch

        ids = [self.tokenizer.encode(t)[-self.max_len:] or [self.pad_id] for t in texts]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        scores = [0.0] * len(ids)
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                rows = order[start:start + self.batch_size]
                width = max(len(ids[i]) for i in rows)
                input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
                mask = torch.zeros((len(rows), width), dtype=torch.long)
                for r, i in enumerate(rows):
                    input_ids[r, :len(ids[i])] = torch.tensor(ids[i])
                    mask[r, :len(ids[i])] = 1
                logits = self.model(input_ids=input_ids.to(self.device),
                                    attention_mask=mask.to(self.device)).logits  # [b, 1]
                for i, value in zip(rows, logits[:, 0].float().tolist()):
                    scores[i] = value
        return scores
