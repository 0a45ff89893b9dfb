"""Stale samples are dropped and counted, never trained on."""

import torch
from test_buffer import make_batch

from llamarl.buffer.record import RolloutBatch
from llamarl.config import load_config
from llamarl.tiny.model import build_model
from llamarl.trainer.rl_step import policy_step
from llamarl.trainer.rollouts import drop_stale
from llamarl.trainer.step import PolicyTrainer


def test_drop_stale_keeps_only_recent_versions():
    old = make_batch(2, 2, seed=1, version=3)
    new = make_batch(2, 2, seed=2, version=5)
    kept, dropped = drop_stale(RolloutBatch.concat([old, new]), version=6, max_staleness=1)
    assert kept.policy_version.tolist() == [5, 5, 5, 5]
    assert dropped.policy_version.tolist() == [3, 3, 3, 3]
    kept, dropped = drop_stale(new, version=6, max_staleness=1)
    assert dropped is None and len(kept) == 4


def test_all_stale_step_counts_drops_and_leaves_weights_untouched():
    cfg = load_config(None, ["trainer.ranks=2", "sync.max_staleness=1"])
    model, tok = build_model(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = PolicyTrainer(model, cfg.trainer, 1, 1, torch.device("cpu"))
    kept, dropped = drop_stale(make_batch(2, 4, seed=3, version=0), version=5, max_staleness=1)
    assert kept is None
    stats = policy_step(trainer, kept, cfg, tok.pad_token_id, version=5, filler=dropped)
    assert stats["dropped"] == 8 and stats["n_seqs"] == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # masked filler: zero gradient
