"""Checkpoint and resume: 6 steps straight == 3 steps + resume + 3 steps (on-policy), PPO's
critic, and a rank SIGKILLed in the middle of a real checkpoint write under torchrun
--max-restarts (the restarted job resumes by itself)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, child_env, complete_rows
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
RECIPE = "recipes/tiny_grpo_cpu.yaml"
COMMON = ["generator.prompts_per_step=8", "data.eval_prompts=16", "run.eval_every=0",
          "run.checkpoint_every=3", "run.name=resume-test"]
TOLERANCE = 1e-5  # max |difference| of any weight after 6 steps


def launch(out: Path, cache: Path, *args: str, recipe: str = RECIPE) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "llamarl.launch", recipe, f"run.output_dir={out}", *COMMON,
           *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(LLAMARL_CACHE=cache),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def only_run(out: Path) -> Path:
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return run


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, cache_dir) -> Path:
    """6 steps uninterrupted (checkpoints at 3 and 6), the reference of the resumed runs."""
    out = tmp_path_factory.mktemp("straight")
    launch(out, cache_dir, "run.steps=6")
    return only_run(out)


def test_resume_continues_exactly(tmp_path, cache_dir, straight_run):
    """6 steps straight == 3 + resume + 3; and the step-3 checkpoint exports as a Hugging Face
    directory with the weights of the policy written after step 3."""
    split = tmp_path / "split"
    launch(split, cache_dir, "run.steps=3")
    first = only_run(split)
    _check_export(first, tmp_path / "exported")
    meta = json.loads((first / "checkpoints" / "step_00000003" / "meta.json").read_text())
    # engine 0's prompt loader right after the 3rd batch (8 prompts each) is what resumes
    assert meta["data_state"]["0"]["loader"]["root"]["it_state"]["source"] == {"epoch": 0,
                                                                              "index": 24}
    # A checkpoint write that was killed halfway must never be picked up.
    shutil.copytree(first / "checkpoints" / "step_00000003",
                    first / "checkpoints" / "step_00000005.partial")
    (first / "checkpoints" / "step_00000005.partial" / "meta.json").unlink()
    proc = launch(split, cache_dir, "run.steps=6", "run.resume=auto")
    assert "resumed from" in proc.stderr and "step_00000003" in proc.stderr
    assert only_run(split) == first, "resume continues in the same run directory"

    a = [json.loads(x) for x in (straight_run / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (first / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert [r["batch_digest"] for r in a] == [r["batch_digest"] for r in b], "data order"
    assert [round(r["reward_mean"], 6) for r in a] == [round(r["reward_mean"], 6) for r in b]

    wa = load_file(straight_run / "policy" / "model.safetensors")
    wb = load_file(first / "policy" / "model.safetensors")
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    print(f"resume: max |weight difference| after 6 steps = {worst:.3g}")
    assert worst <= TOLERANCE
    kept = sorted(p.name for p in (first / "checkpoints").iterdir())
    assert kept == ["step_00000003", "step_00000006"], kept  # keep 2, partial removed

    # A resume that fails (here: nothing left to run) leaves the run's files as they were.
    files = {f: (first / f).read_text() for f in ("recipe.yaml", "model.json")}
    cmd = [sys.executable, "-m", "llamarl.launch", RECIPE, f"run.output_dir={split}", *COMMON,
           "run.steps=6", "run.resume=auto", "trainer.lr=0.5"]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(LLAMARL_CACHE=cache_dir),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "already run.steps = 6" in proc.stderr, proc.stderr[-2000:]
    assert {f: (first / f).read_text() for f in files} == files


def test_lora_resume_continues_exactly(tmp_path, cache_dir):
    """A LoRA run (recipes/tiny_grpo_lora_cpu.yaml, KL to the adapters-off reference): 6
    steps straight == resume from the straight run's step-3 checkpoint + 3 (the same batches
    and rewards, the same merged final policy; as the PPO resume below, the copy keeps steps
    1-3's rows and the resume rewrites the rest), its checkpoints hold the adapters only, and
    the step-3 checkpoint exports as the merged model plus a PEFT adapter directory."""
    recipe = "recipes/tiny_grpo_lora_cpu.yaml"  # (its cosine schedule: run.steps=6 in both)
    straight, split = tmp_path / "straight", tmp_path / "split"
    launch(straight, cache_dir, "run.steps=6", recipe=recipe)
    shutil.copytree(only_run(straight), split / only_run(straight).name)
    first = only_run(split)
    shutil.rmtree(first / "checkpoints" / "step_00000006")
    shutil.rmtree(first / "policy")
    step3 = first / "checkpoints" / "step_00000003"
    assert json.loads((step3 / "meta.json").read_text())["lora"]["rank"] == 8
    from llamarl.export import export
    out = export(step3, tmp_path / "exported")
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert not any("lora" in k for k in load_file(out / "model.safetensors"))
    proc = launch(split, cache_dir, "run.steps=6", "run.resume=auto", recipe=recipe)
    assert "resumed from" in proc.stderr and "step_00000003" in proc.stderr

    a = [json.loads(x) for x in (only_run(straight) / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (first / "metrics.jsonl").read_text().splitlines()]
    assert [r["batch_digest"] for r in a] == [r["batch_digest"] for r in b], "data order"
    assert [round(r["reward_mean"], 6) for r in a] == [round(r["reward_mean"], 6) for r in b]
    assert [round(r["kl_ref"], 6) for r in a] == [round(r["kl_ref"], 6) for r in b]
    assert a[-1]["kl_ref"] > 0, "the reference (adapters off) differs from the policy"
    wa = load_file(only_run(straight) / "policy" / "model.safetensors")
    wb = load_file(first / "policy" / "model.safetensors")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= TOLERANCE


def test_ppo_resume_restores_the_critic(tmp_path, cache_dir):
    """PPO's checkpoint carries the critic, its optimizer and schedule: 4 steps straight ==
    resume from the straight run's step-2 checkpoint + 2, for the policy's weights and the
    critic's value loss at every step. (The resumed copy also holds steps 3-4's rows, as
    after a crash past a checkpoint: the resume rewrites them. Its final policy is removed:
    the one compared below is the resumed run's.)"""
    ppo = dict(recipe="recipes/tiny_ppo_cpu.yaml")
    straight, split = tmp_path / "straight", tmp_path / "split"
    launch(straight, cache_dir, "run.steps=4", "run.checkpoint_every=2", **ppo)
    shutil.copytree(only_run(straight), split / only_run(straight).name)
    shutil.rmtree(only_run(split) / "checkpoints" / "step_00000004")
    shutil.rmtree(only_run(split) / "policy")
    proc = launch(split, cache_dir, "run.steps=4", "run.checkpoint_every=2", "run.resume=auto",
                  **ppo)
    assert "resumed from" in proc.stderr and "step_00000002" in proc.stderr
    a = [json.loads(x) for x in (only_run(straight) / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (only_run(split) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert all(r["value_loss"] > 0 for r in b)
    for ra, rb in zip(a[2:], b[2:]):  # the resumed steps (1-2 are the copy's rows): a critic
        # restarted from scratch would differ from step 3 on
        assert rb["value_loss"] == pytest.approx(ra["value_loss"], rel=1e-4, abs=1e-7)
        assert rb["value_mean"] == pytest.approx(ra["value_mean"], rel=1e-4, abs=1e-7)
    wa = load_file(only_run(straight) / "policy" / "model.safetensors")
    wb = load_file(only_run(split) / "policy" / "model.safetensors")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= TOLERANCE


def _check_export(run: Path, out: Path) -> None:
    """python -m llamarl.export of a run's step-3 checkpoint (its last: the policy written at
    the end of the run has the same weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from llamarl.export import main as export_main

    assert export_main([str(run / "checkpoints" / "step_00000003"), str(out)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out)
    final = AutoModelForCausalLM.from_pretrained(run / "policy")  # same weights: step 3
    for (n, p), (_, q) in zip(exported.named_parameters(), final.named_parameters()):
        assert torch.equal(p, q), n


def test_a_restarted_job_resumes_by_itself(tmp_path, cache_dir, straight_run):
    """torchrun --max-restarts 1, trainer 0 SIGKILLed while it holds step 6's checkpoint open
    (shards on disk, no meta.json, still `.partial`): the restarted world removes the
    half-written checkpoint, resumes from the last complete one (step 3) in the same run
    directory, by itself, and ends with the weights of an uninterrupted run (on-policy)."""
    from llamarl.trainer.checkpoint import TEST_PAUSE_ENV

    steps = ["run.steps=6"]  # (checkpoints every 3 steps: COMMON)
    out = tmp_path / "restarted"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
           "--max-restarts=1", "-m", "llamarl.launch", RECIPE, f"run.output_dir={out}", *COMMON,
           *steps]
    log = tmp_path / "job.log"  # a file, not a pipe: a full pipe would stall the ranks
    with open(log, "w") as f:  # trainer 0 sleeps 3 s before each checkpoint's commit
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(LLAMARL_CACHE=cache_dir,
                                                             **{TEST_PAUSE_ENV: 3}),
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            partial = next(out.glob("*/checkpoints/step_00000006.partial"), None)
            if partial is not None and (partial / ".metadata").exists():
                break  # every shard is written; trainer 0 now sleeps before the commit
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        else:
            pytest.fail("the run never started writing the step-6 checkpoint")
        run = partial.parent.parent
        ranks = complete_rows(run / "ranks.jsonl")
        os.kill(next(r["pid"] for r in ranks if r["role"] == "trainer 0"), signal.SIGKILL)
        assert not (partial / "meta.json").exists(), "killed after the commit point"
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = log.read_text()
    assert proc.returncode == 0, err[-4000:]
    assert "restart 1 of the job: resuming from" in err and "by itself" in err, err[-3000:]
    ckpts = run / "checkpoints"
    assert f"removed the half-written checkpoint {ckpts / 'step_00000006.partial'}" in err
    assert f"resumed from {ckpts / 'step_00000003'} at step 3" in err, err[-3000:]
    assert only_run(out) == run  # the same run directory
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000003", "step_00000006"]
    wa = load_file(straight_run / "policy" / "model.safetensors")
    wb = load_file(run / "policy" / "model.safetensors")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= TOLERANCE
