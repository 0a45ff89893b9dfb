"""The reward model on the trainer sub-mesh (reward.model_placement = trainer): its scores equal
one-at-a-time Hugging Face scores, unsharded here and FSDP2-sharded over 2 real gloo ranks
(uneven shares, a rank with no batch); both tokenizer paths; the weighted add to the rewards."""

import pytest
import torch
from conftest import DIST, reversed_char_tokenizer, save_tiny_reward_model, torchrun

from llamarl.buffer.record import RolloutBatch
from llamarl.config import load_config
from llamarl.tiny.model import build_tokenizer
from llamarl.trainer.reward_model import TrainerRewardModel

PAIRS = [("abc=", "cba"), ("a=", ""), ("abcdef=", "fedcba"), ("ll=", "l"), ("kji=", "ijk"),
         ("b=", "b")]


def text_batch(tok, pairs=PAIRS) -> RolloutBatch:
    """Prompts as the generator makes them ([BOS] + text), completions ending with EOS."""
    prompts = [[tok.bos_token_id] + tok.encode(p) for p, _ in pairs]
    comps = [tok.encode(c) + [tok.eos_token_id] for _, c in pairs]
    lps = [[-0.5] * len(c) for c in comps]
    return RolloutBatch.from_lists(prompts, comps, lps, [1.0] * len(pairs),
                                   list(range(len(pairs))), [True] * len(pairs), 0, 0)


def hf_scores(path, rows: list[list[int]], pool_last: bool = False) -> list[float]:
    """Unsharded, one sequence at a time (no padding): the classifier's own pooled logit.
    `pool_last`: no pad id, so transformers pools at the last token whatever it is."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    if pool_last:
        model.config.pad_token_id = None
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([r])).logits[0, 0]) for r in rows]


def unsharded(path, tok=None) -> TrainerRewardModel:
    return TrainerRewardModel(str(path), tok or build_tokenizer(), "float32",
                              torch.device("cpu"))


def test_scores_the_policy_tokens_in_micro_batches(tiny_reward_model_dir):
    tok = build_tokenizer()
    rm = unsharded(tiny_reward_model_dir, tok)
    assert rm.same_tokenizer
    batch = text_batch(tok)
    rows = [r.tolist() for r in batch.rows()]
    assert rm.token_ids(batch) == rows  # the generated tokens, EOS included
    expected = hf_scores(tiny_reward_model_dir, rows)
    got = rm.score(batch, micro_batch_size=4)  # two micro-batches, rows of different widths
    assert got.tolist() == pytest.approx(expected, abs=1e-5)
    assert len({round(x, 4) for x in expected}) == len(PAIRS)  # real, distinct scores
    assert not any(p.requires_grad for p in rm.model.parameters()) and not rm.model.training

    row = rm.add_scores(batch, 0.5, micro_batch_size=4)
    assert batch.rewards.tolist() == pytest.approx([1 + 0.5 * s for s in expected], abs=1e-5)
    assert row["reward/reward_model"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)
    assert row["reward_model_s"] > 0
    assert len(rm.score(None, 4)) == 0 and rm.add_scores(None, 1.0, 4)["reward/reward_model"] == 0


def test_eos_that_is_the_pad_id_is_scored_as_the_last_token(tmp_path):
    # transformers pools at the rightmost token != pad_token_id: with EOS as the pad id it
    # would read the token before the EOS. The trainer placement reads the last real token.
    path = save_tiny_reward_model(tmp_path / "rm", pad_token_id=build_tokenizer().eos_token_id)
    batch = text_batch(build_tokenizer())
    rows = [r.tolist() for r in batch.rows()]
    got = unsharded(path).score(batch, micro_batch_size=3).tolist()
    assert got == pytest.approx(hf_scores(path, rows, pool_last=True), abs=1e-5)
    assert got != pytest.approx(hf_scores(path, rows), abs=1e-3)


def test_other_tokenizer_scores_the_decoded_text(tmp_path):
    rm_tok = reversed_char_tokenizer()
    path = save_tiny_reward_model(tmp_path / "rm", tokenizer=rm_tok)
    rm = unsharded(path)
    assert not rm.same_tokenizer
    rows = [rm_tok.encode(p + c) for p, c in PAIRS]  # one text, BOS and EOS dropped
    assert rm.token_ids(text_batch(build_tokenizer())) == rows
    got = rm.score(text_batch(build_tokenizer()), micro_batch_size=4).tolist()
    assert got == pytest.approx(hf_scores(path, rows), abs=1e-5)


def test_two_rank_fsdp2_scores_equal_unsharded_scores(tmp_path, tiny_reward_model_dir):
    proc = torchrun(2, [str(DIST / "trainer_reward_model.py")], timeout=300,
                    RM_DIR=tiny_reward_model_dir, OUT=tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"out.{r}") for r in range(2)]
    assert all(out["sharded"] for out in ranks)
    rm = unsharded(tiny_reward_model_dir)
    for case in ("uneven", "one_empty"):
        sizes, scores = [], []
        for out in ranks:
            cols, sharded = out[case]["batch"], out[case]["scores"]
            if cols is None:
                assert len(sharded) == 0
                sizes.append(0)
                continue
            batch = RolloutBatch(**cols)
            expected = hf_scores(tiny_reward_model_dir,
                                 [r.tolist() for r in batch.rows()])
            assert sharded.tolist() == pytest.approx(expected, abs=1e-5), case
            assert rm.score(batch, 2).tolist() == pytest.approx(expected, abs=1e-5), case
            sizes.append(len(batch))
            scores += expected
        assert sizes == ([5, 2] if case == "uneven" else [3, 0])
        for out in ranks:  # the metric is the mean over both ranks' sequences
            assert out[case]["mean"] == pytest.approx(sum(scores) / len(scores), abs=1e-5)


def test_placement_key_and_dynamic_sampling_conflict():
    cfg = load_config(None, ["reward.model_path=/some/rm", "reward.model_placement=trainer"])
    assert cfg.reward.model_placement == "trainer"
    assert load_config(None, []).reward.model_placement == "generator"
    with pytest.raises(ValueError, match=r"'reward.model_placement' = 'gpu'.*generator, trainer"):
        load_config(None, ["reward.model_placement=gpu"])
    with pytest.raises(ValueError, match=r"generator.dynamic_sampling.*model_placement=trainer"):
        load_config(None, ["reward.model_path=/some/rm", "reward.model_placement=trainer",
                           "generator.dynamic_sampling=true"])
    # the default placement keeps dynamic sampling exact
    load_config(None, ["reward.model_path=/some/rm", "generator.dynamic_sampling=true"])

