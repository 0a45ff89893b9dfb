"""On-policy distillation (algorithm.name = on_policy_distill): the teacher's logprobs on the
trainer equal a plain transformers forward (one process in every micro-batch layout, and
FSDP2-sharded over 2 gloo ranks), multi-turn samples are scored on their sampled tokens only, a
teacher equal to the student gives advantages of exactly 0 and an update that changes nothing,
a different teacher pulls the student towards it, and a teacher with another tokenizer is
refused in one line. End to end (slow): the recipe through the launcher, its checkpoint and an
exact resume."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import DIST, ROOT, child_env, reversed_char_tokenizer, torchrun
from safetensors.torch import load_file

from llamarl.algorithms.distill import distill_advantages
from llamarl.buffer.record import RolloutBatch, Sample
from llamarl.config import load_config
from llamarl.tiny.model import build_model, build_tokenizer, save_hf_dir
from llamarl.trainer.policy import load_frozen, load_policy, pad_rollouts
from llamarl.trainer.rl_step import policy_step
from llamarl.trainer.step import PolicyTrainer
from llamarl.trainer.teacher import load_teacher, resolve_teacher_path

CPU = torch.device("cpu")
LAYOUTS = {"padded": ["trainer.share_prompts=false"],
           "packed": ["trainer.max_tokens_per_micro_batch=40"],
           "shared_prompts": ["trainer.share_prompts=true"]}


def multi_turn_batch(seed: int = 0, groups: int = 3, size: int = 3) -> RolloutBatch:
    """Episodes of two sampled turns with an observation between them (context, not sampled):
    each group shares its prompt; token ids within the tiny vocabulary."""
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return torch.randint(4, 30, (int(torch.randint(lo, hi, (1,), generator=g)),),
                             generator=g).tolist()

    samples, gids = [], []
    for grp in range(groups):
        prompt = [1] + ids(2, 6)
        for _ in range(size):
            s = Sample()
            s.add_context(prompt)
            first = ids(1, 5)
            s.add_sampled(first, [-0.5] * len(first), 0)
            s.add_context(ids(1, 4))  # the tool's answer
            second = ids(1, 5) + [2]
            s.add_sampled(second, [-0.5] * len(second), 0)
            s.finish = "stop"
            samples.append(s)
            gids.append(grp)
    rewards = torch.rand(len(samples), generator=g).tolist()
    return RolloutBatch.from_samples(samples, rewards, gids, 0)


def hf_logprobs(path, batch: RolloutBatch) -> torch.Tensor:
    """A plain transformers forward of each row alone (no padding, no FSDP2): [B, T-1] as
    pad_rollouts lays it out, position c - 1 holding the logprob of token c."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    rows = batch.rows()
    out = torch.zeros(len(rows), max(len(r) for r in rows) - 1)
    with torch.no_grad():
        for i, r in enumerate(rows):
            ids = r.long()[None]
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            out[i, :len(r) - 1] = logp.gather(-1, ids[0, 1:, None])[:, 0]
    return out


@pytest.fixture(scope="module")
def other_teacher_dir(tmp_path_factory):
    """A tiny model with the policy's tokenizer and other weights."""
    path = tmp_path_factory.mktemp("teacher") / "model"
    model, tok = build_model(seed=1)
    save_hf_dir(path, model.state_dict(), model.config, tok)
    return path


def distill_update(policy_dir, teacher_dir, batch, *extra: str):
    """One on_policy_distill update of the policy loaded from `policy_dir`, in one process.
    Returns (stats, {a row's tokens: its advantages [len - 1]} from the micro-batches the update
    ran, weights before, weights after)."""
    cfg = load_config(None, ["algorithm.name=on_policy_distill",
                             f"algorithm.teacher_path={teacher_dir}", "trainer.micro_batch_size=3",
                             "trainer.lr=1e-3", "trainer.ranks=1", *extra])
    model = load_policy(str(policy_dir), "float32")
    teacher = load_teacher(cfg, resolve_teacher_path(str(teacher_dir), 0), build_tokenizer(),
                           str(policy_dir), None, CPU)
    trainer = PolicyTrainer(model, cfg.trainer, 1, 1, CPU)
    seen = {}
    step = trainer.step

    def keep_advantages(micro, loss_fn):
        for m in micro:
            for ids, attn, adv in zip(m.input_ids, m.attention_mask, m.advantages):
                n = int(attn.sum())
                seen[tuple(ids[:n].tolist())] = adv[:n - 1]
        return step(micro, loss_fn)

    trainer.step = keep_advantages
    before = copy.deepcopy(model.state_dict())
    stats = policy_step(trainer, batch, cfg, 0, teacher=teacher)
    return stats, seen, before, model.state_dict()


def test_advantages_by_hand():
    s = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
    t = torch.tensor([[-1.5, -1.0, -9.0], [-0.1, -1.0, -4.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    adv, d = distill_advantages(s, t, m, torch.tensor([2.0, -1.0]), 0.5, 0.0)
    assert d.tolist() == [[0.5, -1.0, 0.0], [0.0, -2.0, 0.0]]  # 0 off the mask
    assert adv.tolist() == [[-0.25, 0.5, 0.0], [0.0, 1.0, 0.0]]
    mixed, _ = distill_advantages(s, t, m, torch.tensor([2.0, -1.0]), 0.5, 0.1)
    assert torch.allclose(mixed, adv + 0.1 * torch.tensor([[2.0], [-1.0]]) * m)


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_teacher_equal_to_the_student_gives_zero_advantages_and_no_update(layout,
                                                                          tiny_model_dir):
    batch = multi_turn_batch()
    stats, seen, before, after = distill_update(tiny_model_dir, tiny_model_dir, batch,
                                                *LAYOUTS[layout])
    assert len(seen) == len(batch)
    assert all(torch.equal(a, torch.zeros_like(a)) for a in seen.values()), "advantages not 0"
    assert stats["kl_teacher"] == 0.0 and stats["loss"] == 0.0 and stats["grad_norm"] == 0.0
    assert all(torch.equal(before[k], after[k]) for k in before), "the update changed weights"


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_another_teacher_scores_the_sampled_tokens_and_pulls_the_student_to_it(
        layout, tiny_model_dir, other_teacher_dir, tmp_path):
    batch = multi_turn_batch(seed=1)
    mask = pad_rollouts(batch, 0).mask
    student, teacher = hf_logprobs(tiny_model_dir, batch), hf_logprobs(other_teacher_dir, batch)
    stats, seen, _, after = distill_update(tiny_model_dir, other_teacher_dir, batch,
                                           *LAYOUTS[layout])
    off = 0
    for i, row in enumerate(batch.rows()):
        adv, n = seen[tuple(row.tolist())], len(row) - 1
        assert torch.allclose(adv, -(student - teacher)[i, :n] * mask[i, :n], atol=1e-5)
        context = mask[i, :n] == 0  # the prompt and the tool's answer: never scored
        assert torch.equal(adv[context], torch.zeros_like(adv[context]))
        off += int(((student - teacher)[i, :n][context].abs() > 1e-3).sum())
    assert off > 0, "the models differ on the context tokens too, where nothing is scored"
    assert stats["kl_teacher"] == pytest.approx(float((student - teacher)[mask > 0].sum()),
                                                abs=1e-4)
    assert abs(stats["kl_teacher"]) > 1.0, "a real difference"
    # one small step of the policy-gradient loss raises the student's logprob where the
    # teacher's is higher and lowers it where lower: sum_t (s'_t - s_t)(t_t - s_t) > 0
    model, tok = build_model(seed=0)
    save_hf_dir(tmp_path / "moved", after, model.config, tok)
    s2 = hf_logprobs(tmp_path / "moved", batch)
    assert float(((s2 - student) * (teacher - student) * mask).sum()) > 0


def test_teacher_on_two_fsdp2_ranks_equals_a_plain_transformers_forward(tmp_path,
                                                                        tiny_model_dir):
    """2 gloo ranks, uneven shares: the teacher loaded and sharded as the trainer loads it;
    its logprobs in padded, packed and shared-prompt micro-batches; and a distillation update
    of the sharded policy with the teacher equal to it changes nothing."""
    out = tmp_path / "out"
    proc = torchrun(2, [str(DIST / "distill_teacher.py")], timeout=300, OUT=out,
                    MODEL_DIR=tiny_model_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    batch = multi_turn_batch()
    want = hf_logprobs(tiny_model_dir, batch)
    mask = pad_rollouts(batch, 0).mask
    for layout in LAYOUTS:
        got = torch.zeros_like(want)
        for res in ranks:
            lp = res[layout]
            got[res["rows"], :lp.shape[1]] = lp
        assert torch.allclose(got * mask, want * mask, atol=1e-5), layout
    for res in ranks:
        assert res["sharded"] and res["kl_teacher"] == 0.0 and res["grad_norm"] == 0.0
        assert res["unchanged"], "a distillation update against itself moved the weights"


def test_teacher_with_another_tokenizer_is_refused_in_one_line(tmp_path, tiny_model_dir):
    from transformers import Qwen2ForCausalLM

    from llamarl.tiny.model import build_config

    tok = reversed_char_tokenizer()
    model = Qwen2ForCausalLM(build_config(len(tok)))
    save_hf_dir(tmp_path / "t", model.state_dict(), model.config, tok)
    cfg = load_config(None, ["algorithm.name=on_policy_distill",
                             f"algorithm.teacher_path={tmp_path / 't'}"])
    with pytest.raises(ValueError) as e:
        load_teacher(cfg, str(tmp_path / "t"), build_tokenizer(), str(tiny_model_dir), None, CPU)
    msg = str(e.value)
    assert "\n" not in msg and "algorithm.teacher_path" in msg and "tokenizer" in msg, msg
    with pytest.raises(ValueError, match="no config.json"):
        resolve_teacher_path(str(tmp_path / "missing"), 0)
    assert load_frozen(str(tiny_model_dir), cfg, None, CPU).training is False


@pytest.mark.parametrize("overrides, words", [
    (["algorithm.name=on_policy_distill"], "needs a teacher"),
    (["algorithm.teacher_path=/some/model"], "only algorithm.name=on_policy_distill"),
    (["algorithm.reward_coef=0.5"], "only algorithm.name=on_policy_distill"),
    (["algorithm.name=on_policy_distill", "algorithm.teacher_path=tiny-grpo:lookup"],
     "tiny-grpo:reverse"),
    (["algorithm.name=on_policy_distill", "algorithm.teacher_path=/t",
      "algorithm.distill_coef=0"], "both 0"),
    (["algorithm.name=on_policy_distill", "algorithm.teacher_path=/t",
      "algorithm.reward_coef=1", "generator.samples_per_prompt=1"], "at least 2 samples"),
])
def test_distillation_keys_are_validated(overrides, words):
    with pytest.raises(ValueError, match=words):
        load_config(None, overrides)
    # distillation alone needs no groups
    load_config(None, ["algorithm.name=on_policy_distill", "algorithm.teacher_path=/t",
                       "generator.samples_per_prompt=1"])


def test_recipe_teachers_have_cache_entries_of_their_own(tmp_path, monkeypatch):
    """Each named teacher is its recipe's final policy, cached under a name of its own that
    changes with the recipe (the build itself: the tiny teacher in bench/distill.py's runs)."""
    from llamarl.config import RECIPE_TEACHERS
    from llamarl.models import recipe_teacher

    monkeypatch.setenv("LLAMARL_CACHE", str(tmp_path))
    dirs = {name: recipe_teacher.teacher_dir(name) for name in RECIPE_TEACHERS}
    assert dirs["tiny-grpo:reverse"].name.startswith("tiny-teacher-reverse-")
    assert dirs["smollm2-grpo:add"].name.startswith("smollm2-teacher-add-")
    assert all(d.parent == tmp_path for d in dirs.values())
    recipe, cfg, _ = recipe_teacher._recipe("smollm2-grpo:add")
    assert cfg.model.path == "smollm2:135m-instruct" and recipe.is_file()
    monkeypatch.setattr(recipe_teacher, "VERSION", recipe_teacher.VERSION + 1)
    assert recipe_teacher.teacher_dir("tiny-grpo:reverse") != dirs["tiny-grpo:reverse"]


def _launch(out, cache_dir, teacher_dir, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "llamarl.launch", "recipes/tiny_distill_cpu.yaml",
           f"run.output_dir={out}", f"algorithm.teacher_path={teacher_dir}", "run.steps=4",
           "run.checkpoint_every=2", "generator.prompts_per_step=8", "data.eval_prompts=16",
           "run.eval_every=2", "run.name=distill-test", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(LLAMARL_CACHE=cache_dir),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.slow
def test_recipe_distils_through_the_launcher_and_resumes_exactly(tmp_path, cache_dir,
                                                                 other_teacher_dir):
    """recipes/tiny_distill_cpu.yaml (a teacher of other weights, built here), 4 steps with
    checkpoints at 2 and 4; then the run resumed from its step-2 checkpoint gives the same
    batches, the same reverse KL to the teacher at steps 3-4 and the same final weights."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    proc = _launch(straight, cache_dir, other_teacher_dir)
    assert f"teacher {other_teacher_dir} sharded over 2 trainer rank(s)" in proc.stderr
    (run,) = [p for p in straight.iterdir() if p.is_dir()]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    kl = [r["kl_teacher"] for r in rows]  # the student moves to the teacher: the KL falls
    assert kl[0] > 0.5 and kl[-1] < kl[0] / 2, kl
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2, 4] and all("reward_mean" in e for e in evals)

    shutil.copytree(run, split / run.name)
    shutil.rmtree(split / run.name / "checkpoints" / "step_00000004")
    shutil.rmtree(split / run.name / "policy")
    proc = _launch(split, cache_dir, other_teacher_dir, "run.resume=auto")
    assert "resumed from" in proc.stderr and "step_00000002" in proc.stderr
    again = [json.loads(x) for x in (split / run.name / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(rows[2:], again[2:]):
        assert a["batch_digest"] == b["batch_digest"]
        assert a["kl_teacher"] == pytest.approx(b["kl_teacher"], rel=1e-6)
    wa = load_file(run / "policy" / "model.safetensors")
    wb = load_file(split / run.name / "policy" / "model.safetensors")
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    print(f"distillation resume: max |weight difference| after 4 steps = {worst:.3g}")
    assert worst <= 1e-5  # (as tests/test_resume.py; measured: 0, bitwise)
