"""Packed micro-batches (trainer.max_tokens_per_micro_batch): whole sequences end to end,
attention kept inside each, outputs put back into the padded layout. The update equals the one
with padded micro-batches (loss, statistics, gradients, to float rounding) for an outcome
estimator, a sequence-level loss and PPO with its critic and a KL reference; and on two FSDP2
ranks, packed and with the LM head chunked, it equals one unsharded padded process."""

from __future__ import annotations

import pytest
import torch
from conftest import DIST, torchrun
from test_buffer import make_batch

from llamarl.config import load_config
from llamarl.tiny.model import build_model
from llamarl.trainer import critic as critic_mod
from llamarl.trainer.policy import load_policy, pad_rollouts, token_logprobs
from llamarl.trainer.rl_step import MicroBatching, pack_bins, policy_step
from llamarl.trainer.step import PolicyTrainer

BASE = ["trainer.micro_batch_size=3", "trainer.lr=1e-2", "trainer.ranks=1",
        "trainer.share_prompts=false"]  # padded rows, not the shared-prompt layout
PACKED = ["trainer.max_tokens_per_micro_batch=24"]


def test_pack_bins_is_first_fit_decreasing():
    # 10 -> bin 0; 9 -> bin 1; 7 -> bin 2; 5 -> bin 2 (room 5); 4 -> bin 3; 3 -> bin 1; 2 -> bin 0
    assert pack_bins([5, 9, 3, 7, 2, 10, 4], 12) == [[4, 5], [1, 2], [0, 3], [6]]
    assert pack_bins([20, 3], 8) == [[0], [1]]  # a sequence over the budget goes alone
    assert pack_bins([], 8) == []


def test_packed_logprobs_equal_padded_ones():
    model, tok = build_model(seed=0)
    full = pad_rollouts(make_batch(3, 4, seed=2), tok.pad_token_id)
    packed = full.pack()
    assert packed.packed.input_ids.shape == (1, int(full.attention_mask.sum()))
    assert packed.padding_share() == 0.0 < full.padding_share()
    lp, ent = token_logprobs(model, full, 0.8)
    plp, pent = token_logprobs(model, packed, 0.8)
    scored = full.attention_mask[:, 1:] > 0
    assert torch.allclose(lp[scored], plp[scored], atol=1e-5)
    assert torch.allclose(ent[scored], pent[scored], atol=1e-5)
    assert (plp[~scored] == 0).all() and (pent[~scored] == 0).all()


def test_a_packed_row_passes_its_boundaries_where_the_attention_reads_them():
    """The packer's sequence boundaries: [0, l1, l1 + l2, ...] on the CPU (llamarl_bounds,
    read by the CPU attention's loop) and as int32 for the varlen kernel (cu_seqlens, moved
    with the micro-batch). On the CPU only the CPU ones are passed to the model (on a GPU
    with the varlen kernel only the device ones: FSDP2 would move the CPU ones to the GPU,
    and reading them there made every layer wait for the device; tests/test_gpu.py)."""
    from llamarl.trainer.policy import model_inputs

    _, tok = build_model(seed=0)
    full = pad_rollouts(make_batch(3, 4, seed=2), tok.pad_token_id)
    packed = full.pack().packed
    lens = full.attention_mask.sum(1)
    expect = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    assert torch.equal(packed.bounds, expect) and packed.bounds.device.type == "cpu"
    assert packed.cu_seqlens.dtype == torch.int32 and torch.equal(packed.cu_seqlens.long(),
                                                                  expect)
    assert packed.longest == int(lens.max()) and packed.to(torch.device("cpu")).longest == \
        packed.longest
    inputs = model_inputs(full.pack().to(torch.device("cpu")))
    assert inputs["llamarl_bounds"] is not None and "llamarl_cu_seqlens" not in inputs
    assert "llamarl_max_seqlen" not in inputs
    assert torch.equal(inputs["position_ids"][0, expect[:-1]], torch.zeros(len(lens)).long())


def test_the_varlen_kernel_is_told_the_rows_longest_sequence(monkeypatch):
    """Where the varlen kernel runs, the model gets the device boundaries and the longest
    sequence's length (an int: the kernel's grid is ceil(longest / 128) query blocks per
    sequence, where the row's length launched S times that), and the attention hands both to
    the kernel. The kernel is CUDA's: here it is replaced by a recorder, and only the
    arguments are checked (tests/test_gpu.py runs the kernel itself against the padded
    batch)."""
    from llamarl.trainer import policy, varlen_attention
    from llamarl.trainer.policy import model_inputs

    _, tok = build_model(seed=0)
    full = pad_rollouts(make_batch(3, 4, seed=2), tok.pad_token_id)
    lens = full.attention_mask.sum(1)
    monkeypatch.setattr(policy.varlen_attention, "varlen_available", lambda device: True)
    inputs = model_inputs(full.pack())
    assert inputs["llamarl_max_seqlen"] == int(lens.max()) < int(lens.sum())
    assert "llamarl_bounds" not in inputs  # traced: the device boundaries only

    calls = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, **causal):
        calls.append((cu_q, max_q, max_k))
        return torch.zeros_like(q)

    monkeypatch.setattr(varlen_attention, "_VARLEN", [(kernel, {"is_causal": True})])
    q = torch.zeros(1, 4, int(lens.sum()), 8)
    cu = inputs["llamarl_cu_seqlens"]
    varlen_attention._varlen_cuda(q, q[:, :2], q[:, :2], cu, 1.0, inputs["llamarl_max_seqlen"])
    monkeypatch.setattr(varlen_attention, "PASS_LONGEST", False)
    varlen_attention._varlen_cuda(q, q[:, :2], q[:, :2], cu, 1.0, inputs["llamarl_max_seqlen"])
    longest, total = int(lens.max()), int(lens.sum())
    assert [c[1:] for c in calls] == [(longest, longest), (total, total)]
    assert calls[0][0] is cu


def test_half_precision_attention_computes_in_float32_on_the_cpu(monkeypatch, tiny_model_dir):
    """A bfloat16 model on the CPU: every attention path (padded rows on grouped key/value
    heads, a packed row's per-sequence loop, Hugging Face's sdpa for one unpadded row) gets
    float32 queries, keys and values and hands bfloat16 back, because torch's CPU kernels are
    several times slower in half precision (bench/cpu_half_attention.py). The logprobs and
    gradients stay those of the bfloat16 model to bfloat16 rounding."""
    import torch.nn.functional as F

    from llamarl.trainer import varlen_attention

    _, tok = build_model(seed=0)
    full = pad_rollouts(make_batch(3, 4, seed=2), tok.pad_token_id)
    one = pad_rollouts(make_batch(1, 1, seed=3), tok.pad_token_id)
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):  # every caller looks it up on torch.nn.functional at call time
        seen.append(q.dtype)
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    ref = load_policy(str(tiny_model_dir), "float32")
    grads = {}
    for float32 in (True, False):
        monkeypatch.setattr(varlen_attention, "CPU_HALF_IN_FLOAT32", float32)
        model = load_policy(str(tiny_model_dir), "bfloat16")
        packed = full.pack()
        for batch, calls in ((full, 2), (packed, 2 * (len(packed.packed.bounds) - 1)),
                             (one, 2)):  # 2 layers; the packed row's loop: one per sequence
            want, _ = token_logprobs(ref, batch, 1.0)
            seen.clear()
            lp, _ = token_logprobs(model, batch, 1.0)
            assert seen == [torch.float32 if float32 else torch.bfloat16] * calls
            scored = batch.mask > 0
            assert (lp[scored] - want[scored]).abs().max() < 0.1  # bfloat16's rounding
        model.zero_grad()
        lp, _ = token_logprobs(model, full, 1.0)
        lp[full.mask > 0].float().sum().backward()
        grads[float32] = model.model.layers[0].self_attn.k_proj.weight.grad.float()
        assert torch.isfinite(grads[float32]).all()
    assert torch.allclose(grads[True], grads[False], rtol=0.1, atol=0.05 * grads[True].abs().max())


def _update(extra: list[str], model_dir) -> tuple[dict, dict]:
    cfg = load_config(None, BASE + extra)
    model, tok = build_model(seed=0)
    trainer = PolicyTrainer(model, cfg.trainer, 1, 1, torch.device("cpu"))
    critic = reference = None
    if cfg.algorithm.name == "ppo":
        critic = PolicyTrainer(critic_mod.load_critic(str(model_dir), "float32"), cfg.trainer, 1,
                               1, torch.device("cpu"),
                               forward=lambda m, mb: (critic_mod.values(m, mb), None),
                               name="critic")
    if cfg.algorithm.kl_coef > 0:
        reference = load_policy(str(model_dir), "float32").requires_grad_(False).eval()
    stats = policy_step(trainer, make_batch(4, 4, seed=5), cfg, tok.pad_token_id,
                        reference=reference, critic=critic)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if critic is not None:
        grads.update({f"critic.{n}": p.grad.clone()
                      for n, p in critic.model.named_parameters() if p.grad is not None})
    return stats, grads


# an outcome estimator, a sequence-level loss, PPO with its critic and a KL reward (two
# mini-batches): the updates compared with padded rows (also by tests/test_shared_prompts.py)
ALGORITHMS = pytest.mark.parametrize("alg", [
    ["algorithm.name=grpo"],
    ["algorithm.name=gspo", "algorithm.loss_agg=seq_mean_token_mean"],
    ["algorithm.name=ppo", "algorithm.kl_coef=0.1", "algorithm.kl_mode=reward",
     "algorithm.kl_estimator=k1", "algorithm.mini_batches=2", "critic.lr=1e-2"],
], ids=["grpo", "gspo", "ppo_kl"])


@ALGORITHMS
def test_packed_and_padded_updates_give_the_same_gradients(alg, tiny_model_dir):
    padded, g_padded = _update(alg, tiny_model_dir)
    packed, g_packed = _update(alg + PACKED, tiny_model_dir)
    # (rows of similar lengths share a padded micro-batch, rl_step.by_length: less padding,
    # but some, so packed and padded forwards differ)
    assert padded["padding_share"] > 0.03 and packed["padding_share"] == 0.0
    for key, value in padded.items():
        if key != "padding_share":
            assert packed[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert g_padded.keys() == g_packed.keys()
    for name, g in g_padded.items():
        assert torch.allclose(g_packed[name], g, rtol=1e-4, atol=1e-6), name
    assert max(g.abs().max() for g in g_padded.values()) > 1e-3  # a real update


@pytest.mark.parametrize("layout", [PACKED[0], "trainer.share_prompts=true"],
                         ids=["packed", "shared_prompts"])
def test_two_fsdp2_ranks_with_a_chunked_head_match_one_padded_process(tmp_path, layout):
    """Under FSDP2 the chunked head runs inside the root's forward (its tied weight unsharded)
    and its gradient reaches the sharded embedding: the same step as one plain process, packed
    or with shared prompts (trainer/shared_prompts.py: the head then reads gathered entries)."""
    proc = torchrun(2, [str(DIST / "fsdp_policy_step.py")], timeout=300, OUT=tmp_path / "o.pt",
                    EXTRA=layout, CHUNK_MIB="0.0001")  # one position per span
    assert proc.returncode == 0, proc.stderr[-3000:]
    sharded = torch.load(tmp_path / "o.pt")
    cfg = load_config(None, ["trainer.micro_batch_size=3", "trainer.lr=1e-2",
                             "trainer.ranks=2", "trainer.share_prompts=false"])
    model, tok = build_model(seed=0)
    trainer = PolicyTrainer(model, cfg.trainer, 1, 1, torch.device("cpu"))
    stats = policy_step(trainer, make_batch(4, 4, seed=5), cfg, tok.pad_token_id)
    assert sharded["stats"]["loss"] == pytest.approx(stats["loss"], abs=1e-5)
    assert sharded["stats"]["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-4)
    # gradients, not Adam's steps: Adam turns a rounding-level gradient into a whole lr step
    for name, p in model.named_parameters():
        assert torch.allclose(sharded["grads"][name], p.grad, rtol=1e-4, atol=1e-6), name


def test_padded_micro_batches_hold_rows_of_similar_lengths():
    """Without a token budget, micro-batches of `trainer.micro_batch_size` rows take the rows
    longest first (rl_step.by_length): every row once, each micro-batch padded only to its own
    longest row, and less padding than cutting the rows in the batch's order (a batch's groups
    of one prompt each) computed."""
    from llamarl.trainer.rl_step import _cut, _filler

    _, tok = build_model(seed=0)
    batch = make_batch(8, 4, seed=3)
    full = pad_rollouts(batch, tok.pad_token_id)
    lens = full.attention_mask.sum(1)
    blank = _filler(batch, tok.pad_token_id)
    cut = _cut(full, torch.arange(len(lens)), blank, MicroBatching(5))
    rows = torch.cat([r for r, _ in cut])
    assert sorted(rows.tolist()) == list(range(len(lens)))
    widths = [mb.input_ids.shape[1] for _, mb in cut]
    assert widths == [max(int(lens[r].max()), 2) for r, _ in cut]
    assert widths == sorted(widths, reverse=True)
    computed = sum(mb.input_ids.numel() for _, mb in cut)
    in_order = sum(max(int(lens[r].max()), 2) * len(r) for r in torch.arange(len(lens)).split(5))
    assert computed < in_order
