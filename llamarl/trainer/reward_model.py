"""The reward model on the trainer sub-mesh (reward.model_placement = trainer): a frozen
`AutoModelForSequenceClassification` (one label), FSDP2-sharded over the trainer ranks like the
reference policy, for reward models too big to sit unsharded beside a vLLM engine.

Each trainer rank scores its own share of the rollout batch (n_r sequences) before the RL update:

    ids_i = token_ids_i (the whole sample)        the policy's tokens, when the reward model's
                                                   tokenizer has the policy's vocabulary
          = encode_RM(decode_policy(token_ids_i, skip special tokens))
                                                   otherwise (one text, as the generator
                                                   placement scores prompt + completion)
    s_i   = logit of the reward model at the last token of ids_i      ([B, T, 1] -> [B])
    reward_i += reward.model_weight * s_i

Sequences longer than the model's context keep their last tokens. A rank sorts its sequences by
length and cuts them into micro-batches of trainer.micro_batch_size, right-padded. The score is
read at each row's last attended position rather than at "the last token that is not
pad_token_id" (what transformers' pooling does): the two agree except when a sequence ends with
a token equal to the pad id, e.g. an EOS that doubles as the pad token (Qwen2.5 base models).

FSDP2 makes every forward a collective: every rank runs M = max_r ceil(n_r / micro_batch_size)
forwards; a rank with fewer sequences (an uneven split, stale samples dropped, or none at all)
runs one-token filler forwards whose output is ignored.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from llamarl.buffer.record import RolloutBatch
from llamarl.parallel.fsdp import apply_fsdp
from llamarl.rewards.reward_model import load_reward_model
from llamarl.trainer.policy import DTYPES


class TrainerRewardModel:
    def __init__(self, path: str, policy_tokenizer, dtype: str, device: torch.device,
                 mesh=None):
        """`mesh`: the trainer mesh to shard over (None: unsharded, one process)."""
        model, self.tokenizer, self.pad_id, self.max_len = load_reward_model(path, DTYPES[dtype])
        self.policy_tokenizer = policy_tokenizer
        # Same vocabulary: a policy token id names the same token for the reward model, so the
        # generated tokens are scored exactly as sampled (no decode/encode round trip).
        self.same_tokenizer = self.tokenizer.get_vocab() == policy_tokenizer.get_vocab()
        self.device = device
        self.model = model.to(device)
        if mesh is not None:
            apply_fsdp(self.model, mesh, param_dtype=DTYPES[dtype])
        # The per-token logits [B, T, 1] of the `score` head, taken from inside the forward
        # (transformers returns only its own pooled [B, 1]); see the module docstring.
        self._token_logits: torch.Tensor | None = None
        self.model.score.register_forward_hook(self._keep_token_logits)

    def _keep_token_logits(self, _module, _inputs, output: torch.Tensor) -> None:
        self._token_logits = output

    def token_ids(self, batch: RolloutBatch) -> list[list[int]]:
        """The reward model's input ids of every sequence of `batch` (see the module docstring)."""
        out = []
        for row in batch.rows():
            ids = row.tolist()
            if not self.same_tokenizer:
                text = self.policy_tokenizer.decode(ids, skip_special_tokens=True)
                ids = self.tokenizer.encode(text)
            out.append(ids[-self.max_len:] or [self.pad_id])
        return out

    def score(self, batch: RolloutBatch | None, micro_batch_size: int) -> torch.Tensor:
        """s_i of every sequence of this rank's `batch` (None: no sequences), [n] float32 on the
        CPU, in batch order. Collective over the trainer ranks: every rank must call it."""
        ids = self.token_ids(batch) if batch is not None and len(batch) else []
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        scores = torch.zeros(len(ids))
        n_micro = _max_over_ranks(math.ceil(len(ids) / micro_batch_size))
        with torch.no_grad():
            for k in range(n_micro):
                rows = order[k * micro_batch_size:(k + 1) * micro_batch_size]
                values = self._forward([ids[i] for i in rows] or [[self.pad_id]])
                if rows:
                    scores[rows] = values
        return scores

    def _forward(self, seqs: list[list[int]]) -> torch.Tensor:
        """One right-padded micro-batch -> the logit at each row's last token, [b] float32."""
        width = max(len(s) for s in seqs)
        input_ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, s in enumerate(seqs):
            input_ids[r, :len(s)] = torch.tensor(s)
            mask[r, :len(s)] = 1
        self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device))
        last = torch.tensor([len(s) - 1 for s in seqs])
        logits, self._token_logits = self._token_logits, None
        return logits[torch.arange(len(seqs)), last.to(logits.device), 0].float().cpu()

    def add_scores(self, batch: RolloutBatch | None, weight: float,
                   micro_batch_size: int) -> dict:
        """Score this rank's batch and add `weight` x score to batch.rewards (in place).
        Collective. Returns the metrics: the mean score over every trainer rank's sequences
        (unweighted, like the generator placement's reward/reward_model) and the seconds taken."""
        t0 = time.perf_counter()
        scores = self.score(batch, micro_batch_size)
        if len(scores):
            batch.rewards += weight * scores
        total = torch.tensor([float(scores.sum()), float(len(scores))])
        if dist.is_initialized():
            dist.all_reduce(total)
        return {"reward/reward_model": float(total[0]) / max(float(total[1]), 1.0),
                "reward_model_s": time.perf_counter() - t0}


def build_reward_model(cfg, policy_tokenizer, mesh, device: torch.device):
    """The trainer-side reward model, or None unless reward.model_path is set with
    reward.model_placement = trainer."""
    r = cfg.reward
    if not r.model_path or r.model_placement != "trainer":
        return None
    return TrainerRewardModel(r.model_path, policy_tokenizer, cfg.model.dtype, device, mesh)


def _max_over_ranks(value: int) -> int:
    count = torch.tensor([float(value)])
    if dist.is_initialized():
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count)
