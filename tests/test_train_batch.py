"""The trainer's padded batch: built once from the flat rollout columns, sliced into
micro-batches; the same tensors the per-row collation gave."""

from __future__ import annotations

import torch
from test_buffer import make_batch

from llamarl.buffer.record import RolloutBatch, Sample
from llamarl.trainer.policy import collate, pad_rollouts


def _per_row(batch: RolloutBatch):
    seqs = []
    for row, p, lp, m in zip(batch.rows(), batch.prompt_lens.tolist(),
                             batch.logprobs.split(batch.seq_lens.tolist()),
                             batch.loss_mask.split(batch.seq_lens.tolist())):
        ids = row.tolist()
        seqs.append((ids[:p], ids[p:], lp[m > 0].tolist()))
    return seqs


def test_padded_batch_equals_per_row_collation():
    batch = make_batch(4, 3, seed=11)
    full = pad_rollouts(batch, pad_id=0)
    ref = collate(_per_row(batch), pad_id=0)
    for name in ("input_ids", "attention_mask", "targets", "mask", "old_logp"):
        assert torch.equal(getattr(full, name), getattr(ref, name)), name
    rows = [5, 1, 2]
    part = full.take(rows)
    ref_part = collate([_per_row(batch)[i] for i in rows], pad_id=0)
    for name in ("input_ids", "attention_mask", "targets", "mask", "old_logp"):
        assert torch.equal(getattr(part, name), getattr(ref_part, name)), name


def test_padded_multi_turn_sample_scores_only_sampled_tokens():
    s = Sample()
    s.add_context([1, 2])
    s.add_sampled([5, 6], [-0.1, -0.2], version=0)
    s.add_context([9, 9])
    s.add_sampled([7, 3], [-0.3, -0.4], version=1)
    tb = pad_rollouts(RolloutBatch.from_samples([s], [1.0], [0], 0), pad_id=0)
    # position t scores token t + 1: tokens 2, 3 (5, 6) and 6, 7 (7, 3) are the policy's
    assert tb.mask.tolist() == [[0, 1, 1, 0, 0, 1, 1]]
    assert torch.allclose(tb.old_logp, torch.tensor([[0, -0.1, -0.2, 0, 0, -0.3, -0.4]]))
    assert tb.targets.tolist() == [[2, 5, 6, 9, 9, 7, 3]]
