"""Shared-prompt micro-batches (trainer.share_prompts): the rows of a group run as one tree,
the prompt once and each sample after it attending to the prompt and to itself. The layout
(which rows share, positions, mask, scored entries), logprobs equal to the padded rows' (whole
and chunked head, single- and multi-turn samples), and the update's loss, statistics and
gradients equal to the padded update's for an outcome estimator, a sequence-level loss and PPO
with its critic and a KL reference."""

from __future__ import annotations

import pytest
import torch
from test_buffer import make_batch
from test_packing import ALGORITHMS, _update

from llamarl.buffer.record import RolloutBatch, Sample
from llamarl.config import load_config
from llamarl.tiny.model import build_model
from llamarl.trainer.policy import pad_rollouts, token_logprobs
from llamarl.trainer.rl_step import by_group
from llamarl.trainer.shared_prompts import share_prompts

SHARED = ["trainer.share_prompts=true"]


def test_the_rows_of_a_group_become_one_tree():
    # group 7: prompt [5, 6, 7], samples [8, 9] and [10]; group 8: prompt [5, 6], sample
    # [11, 12, 13]; a row of group 7 whose prompt differs ([5, 6, 9]) is a tree of its own
    pad = 0
    rows = [[5, 6, 7, 8, 9], [5, 6, 9, 4], [5, 6, 11, 12, 13], [5, 6, 7, 10]]
    ids = torch.tensor([r + [pad] * (5 - len(r)) for r in rows])
    attn = (torch.arange(5)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
    t = share_prompts(ids, attn, torch.tensor([3, 3, 2, 3]), torch.tensor([7, 7, 8, 7]))
    assert t.input_ids.tolist() == [[5, 6, 7, 8, 9, 10], [5, 6, 9, 4, 0, 0],
                                    [5, 6, 11, 12, 13, 0]]
    assert t.position_ids.tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 2, 3, 0, 0],
                                       [0, 1, 2, 3, 4, 0]]
    assert t.tokens == 6 + 4 + 5
    m = t.attention_mask[0, 0].int().tolist()
    assert m[1] == [1, 1, 0, 0, 0, 0]  # a prompt token: the earlier prompt
    assert m[4] == [1, 1, 1, 1, 1, 0]  # sample 1's second token: the prompt and sample 1
    assert m[5] == [1, 1, 1, 0, 0, 1]  # sample 2's token: the prompt and itself, not sample 1
    assert (t.attention_mask[1, 0].diagonal()).all()  # padding attends to itself: no NaN
    # scored: position c of row b (c >= p_b - 1) scores token c + 1 from one tree position
    assert t.dst_row.tolist() == [0, 0, 1, 2, 2, 2, 3]
    assert t.dst_col.tolist() == [2, 3, 2, 1, 2, 3, 2]
    L = t.input_ids.shape[1]
    assert t.gather.tolist() == [2, 3, L + 2, 2 * L + 1, 2 * L + 2, 2 * L + 3, 2]
    assert t.targets.tolist() == [[8, 9, 4, 11, 12, 13, 10]]


def test_by_group_keeps_groups_together_longest_first():
    lens = torch.tensor([5, 3, 4, 9, 4])
    prompt_lens = torch.tensor([2, 2, 2, 8, 2])
    gids = torch.tensor([1, 2, 1, 3, 2])
    # trees: group 1: 2 + 3 + 2 = 7, group 2: 2 + 1 + 2 = 5, group 3: 8 + 1 = 9
    order = by_group(torch.arange(5) + 10, lens, prompt_lens, gids)
    assert order.tolist() == [13, 10, 12, 11, 14]


def _multi_turn_batch() -> RolloutBatch:
    """Two groups of 3 episodes: a prompt, a sampled turn, a tool's output, another turn."""
    g = torch.Generator().manual_seed(4)
    samples, gids = [], []
    for grp in range(2):
        prompt = torch.randint(4, 30, (4 + grp,), generator=g).tolist()
        for _ in range(3):
            s = Sample(finish="stop")
            s.add_context(prompt)
            for turn in range(2):
                n = int(torch.randint(1, 5, (1,), generator=g))
                s.add_sampled(torch.randint(4, 30, (n,), generator=g).tolist(),
                              (-torch.rand(n, generator=g)).tolist(), 0)
                if turn == 0:
                    s.add_context(torch.randint(4, 30, (2,), generator=g).tolist())
            samples.append(s)
            gids.append(grp)
    return RolloutBatch.from_samples(samples, [0.5] * len(samples), gids, 0)


@pytest.mark.parametrize("batch", ["single_turn", "multi_turn"])
@pytest.mark.parametrize("chunk_mib", [None, 0.0001], ids=["whole_head", "chunked_head"])
def test_shared_logprobs_equal_padded_ones(batch, chunk_mib):
    model, tok = build_model(seed=0)
    rb = make_batch(3, 4, seed=2) if batch == "single_turn" else _multi_turn_batch()
    full = pad_rollouts(rb, tok.pad_token_id)
    shared = full.share()
    assert shared.shared.input_ids.shape[0] == len(set(rb.group_ids.tolist()))
    assert shared.computed_tokens()[0] < int(full.attention_mask.sum())  # prompts once
    lp, ent = token_logprobs(model, full, 0.8, chunk_mib=chunk_mib)
    slp, sent = token_logprobs(model, shared, 0.8, chunk_mib=chunk_mib)
    # every position from the last prompt token on is scored (tool tokens too), none before
    col = torch.arange(full.mask.shape[1])[None]
    after = (col >= full.prompt_lens[:, None] - 1) & (full.attention_mask[:, 1:] > 0)
    assert full.mask[~after].sum() == 0
    assert torch.allclose(lp[after], slp[after], atol=1e-5)
    assert torch.allclose(ent[after], sent[after], atol=1e-5)
    assert (slp[~after] == 0).all()
    # the gradient of the loss's tokens reaches the weights the same way
    for logp in (lp, slp):
        model.zero_grad()
        (logp * full.mask).sum().backward()
        if logp is lp:
            expect = {n: p.grad.clone() for n, p in model.named_parameters()}
    # float32 sums of other shapes (the shared layout's rows) round differently per BLAS
    # kernel: up to ~7e-7 of the gradient's scale on some CPUs (the tied embedding's 7.6e-6
    # where its largest entry is 11.7), so the absolute tolerance follows each tensor's scale
    for n, p in model.named_parameters():
        scale = max(1.0, float(expect[n].abs().max()))
        assert torch.allclose(p.grad, expect[n], rtol=1e-4, atol=2e-6 * scale), n


@ALGORITHMS
def test_shared_and_padded_updates_give_the_same_gradients(alg, tiny_model_dir, monkeypatch):
    from llamarl.trainer.policy import TokenBatch

    padded, g_padded = _update(alg, tiny_model_dir)
    trees = []
    share = TokenBatch.share
    monkeypatch.setattr(TokenBatch, "share", lambda self: trees.append(share(self)) or trees[-1])
    shared, g_shared = _update(alg + SHARED, tiny_model_dir)
    # the forwards ran on trees: fewer rows than samples (micro-batches of 3, groups of 4)
    assert sum(t.shared.input_ids.shape[0] for t in trees) < sum(len(t.mask) for t in trees)
    assert padded["shared_prompts"] == 0.0 and shared["shared_prompts"] == 1.0
    for key, value in padded.items():
        if key not in ("padding_share", "shared_prompts"):
            assert shared[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert g_padded.keys() == g_shared.keys()
    for name, g in g_padded.items():
        assert torch.allclose(g_shared[name], g, rtol=1e-4, atol=1e-6), name
    assert max(g.abs().max() for g in g_padded.values()) > 1e-3  # a real update


def test_shared_prompts_are_checked_against_what_they_need():
    with pytest.raises(ValueError, match="trainer.max_tokens_per_micro_batch: 0"):
        load_config(None, SHARED + ["trainer.max_tokens_per_micro_batch=64"])
    with pytest.raises(ValueError, match="model.attn_implementation: sdpa"):
        load_config(None, SHARED + ["model.attn_implementation=eager"])
    with pytest.raises(ValueError, match="must be auto, true or false"):
        load_config(None, ["trainer.share_prompts=sometimes"])
    assert load_config(None, ["trainer.share_prompts=True"]).trainer.share_prompts == "true"


def _long_responses(n_groups: int, size: int, prompt: int, lo: int, hi: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    ps, cs, lps, gids = [], [], [], []
    for grp in range(n_groups):
        p = torch.randint(4, 30, (prompt,), generator=g).tolist()
        for _ in range(size):
            n = int(torch.randint(lo, hi + 1, (1,), generator=g))
            ps.append(p)
            cs.append([5] * n)
            lps.append([-0.1] * n)
            gids.append(grp)
    return RolloutBatch.from_lists(ps, cs, lps, [0.0] * len(ps), gids, [True] * len(ps), 0, 0)


def test_auto_shares_prompts_where_the_flops_estimate_says_it_is_cheaper():
    """share_prompts: auto weighs the tokens and the attention's (query, key) pairs that each
    layout computes: the default recipe's shapes (prompts of 8-15 tokens, answers of 1-12) on
    the tiny model share; a 24M-like model with answers of 64-128 tokens after 12-token
    prompts keeps padded rows (a group's tree of ~800 tokens costs its dense square); packed
    micro-batches and other attentions never share."""
    from types import SimpleNamespace

    from llamarl.trainer.rl_step import MicroBatching

    tiny, _ = build_model(seed=0)
    cfg = load_config(None, ["trainer.micro_batch_size=64"])
    assert cfg.trainer.share_prompts == "auto"
    mb = MicroBatching.of(cfg, tiny)
    short = pad_rollouts(_long_responses(16, 8, 11, 1, 12), 0)
    args = short.attention_mask.sum(1), short.prompt_lens, short.group_ids
    assert mb.shared_is_cheaper(*args, by_group(torch.arange(len(args[0])), *args))
    big = SimpleNamespace(config=SimpleNamespace(hidden_size=512, intermediate_size=1536))
    cfg = load_config(None, ["trainer.micro_batch_size=32"])
    long = pad_rollouts(_long_responses(4, 8, 12, 64, 128), 0)
    args = long.attention_mask.sum(1), long.prompt_lens, long.group_ids
    assert not MicroBatching.of(cfg, big).shared_is_cheaper(
        *args, by_group(torch.arange(len(args[0])), *args))
    for extra in (["trainer.max_tokens_per_micro_batch=64"], ["model.attn_implementation=eager"]):
        assert MicroBatching.of(load_config(None, extra), tiny).share == "false"
    assert MicroBatching.of(load_config(None, SHARED), tiny).share == "true"
