"""End to end through the real launcher on the real recipe: a few GRPO steps, the run directory,
the exported policy, and the failure paths (bad world size, a rank killed with SIGKILL)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, child_env, complete_rows, rank_line, torchrun

from llamarl.models import precision

pytestmark = pytest.mark.slow
RECIPE = "recipes/tiny_grpo_cpu.yaml"
SMALL = ["generator.prompts_per_step=8", "data.eval_prompts=16", "run.eval_every=2"]


def run_dirs(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if p.is_dir()) if out.exists() else []


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, cache_dir):
    """The default recipe, 3 steps, with model.dtype=bfloat16: engines and the trainer's
    forward/backward in bf16 over float32 master weights, weights sent as bf16 (half the
    bytes), the exported policy in bf16. (float32, the default: on-policy resumes match an
    uninterrupted run's weights to 1e-5 in test_resume.py; mismatch_kl < 1e-4 in
    test_file_transport.py and test_tp.py.)"""
    out = tmp_path_factory.mktemp("runs")
    cmd = [sys.executable, "-m", "llamarl.launch", RECIPE, "run.steps=3", "model.dtype=bfloat16",
           f"run.output_dir={out}", *SMALL]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(LLAMARL_CACHE=cache_dir),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    (run,) = run_dirs(out)
    return run, proc, time.monotonic() - t0


def test_launch_writes_the_run_directory(finished_run):
    run, proc, _ = finished_run
    assert f"run directory: {run}" in proc.stdout
    assert "held-out reward" in proc.stderr and "before" in proc.stderr
    # a bfloat16 this CPU runs in torch's fallback loop is named once (models/precision.py)
    slow = not (precision.has_gpu() or precision.cpu_bfloat16_is_fast())
    assert proc.stderr.count("model.dtype=bfloat16 on a CPU without") == int(slow)
    assert (run / "recipe.yaml").read_text().strip()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("reward_mean", "policy_version", "step_time_s", "tokens_generated",
                    "generate_s", "transfer_s", "train_s", "sync_s"):
            assert key in r, key
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["tokens_generated"] > 0
        # the engine samples from exactly the trainer's weights, up to bf16 rounding
        assert r["mismatch_kl"] < 1e-3, "engine and trainer disagree after weight syncs"
        # the step's parts and the trainer's bookkeeping (other_s) make up its period
        parts = sum(r[k] for k in ("wait_s", "transfer_s", "train_s", "sync_s",
                                   "checkpoint_s", "other_s"))
        assert r["other_s"] >= 0.0 and abs(parts - r["step_time_s"]) < 1e-6
    # step times are periods: they sum to the run's wall-clock time, as a peer's clock reads
    assert abs(sum(r["step_time_s"] for r in rows) - rows[-1]["elapsed_s"]) < 1e-6
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2, 3]
    roles = [json.loads(x)["role"] for x in (run / "ranks.jsonl").read_text().splitlines()]
    assert sorted(roles) == ["generator 0", "trainer 0", "trainer 1"]
    assert not list(Path("/dev/shm").glob(f"llamarl_{run.name.split('-', 2)[-1]}*"))


def test_final_policy_loads_in_transformers(finished_run):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = finished_run[0] / "policy"
    with safe_open(str(policy / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    model = AutoModelForCausalLM.from_pretrained(policy)
    tok = AutoTokenizer.from_pretrained(policy)
    ids = torch.tensor([[tok.bos_token_id] + tok.encode("abc=", add_special_tokens=False)])
    assert model(ids).logits.shape[-1] == len(tok)


def test_final_policy_loads_in_vllm(finished_run):
    policy = finished_run[0] / "policy"
    code = ("from llamarl.config import GeneratorConfig\n"
            "from llamarl.generator.engine import Engine\n"
            "if __name__ == '__main__':\n"
            f"    e = Engine({str(policy)!r}, GeneratorConfig(max_model_len=64), 'float32', 0,"
            " True)\n"
            "    out = e.generate([[1, 4, 5, 16]], 2, 1.0, 8, seed=0)\n"
            "    print('GEN', len(out[0]), len(out[0][0].token_ids))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "GEN 2" in proc.stdout, proc.stderr[-3000:]


def test_world_size_that_does_not_fit_is_a_one_line_error(tmp_path):
    t0 = time.monotonic()
    proc = torchrun(2, ["-m", "llamarl.launch", RECIPE, f"run.output_dir={tmp_path}"],
                    timeout=120)
    assert proc.returncode != 0
    assert "world size 2 does not fit the recipe" in proc.stderr
    assert "--nproc-per-node 3" in proc.stderr
    assert time.monotonic() - t0 < 60
    assert not run_dirs(tmp_path), "nothing may start when the layout does not fit"


def test_failing_reward_function_stops_every_rank_naming_the_generator(tmp_path, cache_dir):
    t0 = time.monotonic()
    proc = torchrun(3, ["-m", "llamarl.launch", RECIPE, "run.steps=5",
                        f"run.output_dir={tmp_path}", "reward.functions=[user_rewards:broken]",
                        *SMALL], timeout=300, LLAMARL_CACHE=cache_dir,
                    PYTHONPATH=Path(__file__).parent)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    line = rank_line(out, "rank 0 (trainer 0)")
    assert line is not None, out[-6000:]
    assert "rank 2 (generator 0)" in line and "user_rewards:broken" in line, line
    assert "ZeroDivisionError" in line
    assert time.monotonic() - t0 < 240
    (run,) = run_dirs(tmp_path)
    assert not list(Path("/dev/shm").glob(f"llamarl_{run.name.split('-', 2)[-1]}*"))


# srun-style (one process per rank, no agent that kills the others): the watchdogs alone must
# stop every rank. (A trainer killed under torchrun: test_resume.py, whose job restarts.)
@pytest.mark.parametrize("victim", ["generator 0"])
def test_killed_rank_stops_every_rank_with_a_named_error(tmp_path, cache_dir, victim):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [_slurm_rank(r, 7, port, tmp_path, cache_dir, steps=100000) for r in range(3)]
    try:
        deadline = time.monotonic() + 300
        metrics = None
        while time.monotonic() < deadline:
            runs = run_dirs(tmp_path)
            metrics = runs[0] / "metrics.jsonl" if runs else None
            if metrics and metrics.exists() and len(complete_rows(metrics)) >= 2:
                break
            assert all(p.poll() is None for p in procs), procs[0].communicate()[0][-3000:]
            time.sleep(0.5)
        else:
            pytest.fail("the run never reached step 2")
        run = metrics.parent
        ranks = complete_rows(run / "ranks.jsonl")
        dead = next(r for r in ranks if r["role"] == victim)
        others = [r["pid"] for r in ranks if r is not dead]
        os.kill(dead["pid"], signal.SIGKILL)
        t_kill = time.monotonic()
        outs = [p.communicate(timeout=90)[0] for r, p in enumerate(procs) if r != dead["rank"]]
        elapsed = time.monotonic() - t_kill
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert all(p.returncode != 0 for p in procs)
    assert elapsed < 60, f"took {elapsed:.1f} s to stop"
    for out in outs:  # every survivor names the dead rank
        assert f"rank {dead['rank']} ({victim})" in out, out[-3000:]
    named = [line for out in outs for line in out.splitlines() if "llamarl:" in line]
    print(f"stopped {elapsed:.1f} s after SIGKILL; messages: {named}")
    for pid in others:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    run_id = run.name.split("-", 2)[-1]
    assert not list(Path("/dev/shm").glob(f"llamarl_{run_id}*"))


def test_slurm_launch_without_torchrun(tmp_path, cache_dir):
    """srun-style: one process per rank, placement from SLURM_* variables, rank 0 hosts the
    store."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(3):
        env = child_env(LLAMARL_CACHE=cache_dir, SLURM_PROCID=rank, SLURM_NTASKS=3,
                        SLURM_NNODES=1, SLURM_LOCALID=rank, SLURM_JOB_ID=4242,
                        SLURM_JOB_NODELIST="localhost", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=port)
        cmd = [sys.executable, "-m", "llamarl.launch", RECIPE, "run.steps=2",
               f"run.output_dir={tmp_path}", *SMALL]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(outs)[-4000:]
    (run,) = run_dirs(tmp_path)
    assert json.loads((run / "layout.json").read_text())["launcher"] == "slurm"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert "run directory:" in outs[0]


def test_plot_writes_charts_and_a_chrome_trace(finished_run):
    from llamarl.plot import main as plot_main

    run = finished_run[0]
    assert plot_main([str(run)]) == 0
    for name in ("reward.png", "timeline.png", "timeline.trace.json"):
        assert (run / "plots" / name).stat().st_size > 0, name
    trace = json.loads((run / "plots" / "timeline.trace.json").read_text())
    phases = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"generate", "train", "sync", "load_weights", "wait_rollouts"} <= phases
    assert {e["tid"] for e in trace["traceEvents"]} == {0, 1, 2}


# Recipes that run through the launcher in other tests, with their own checks (kept out of this
# one to keep the suite short): tiny_tool_cpu.yaml (test_multi_turn.py), tiny_grpo_cpu.yaml
# (finished_run above, in bfloat16; float32 in test_resume.py), tiny_ppo_cpu.yaml
# (test_resume.py), tiny_grpo_tp2_cpu.yaml (test_tp.py, test_file_transport.py),
# tiny_grpo_async_cpu.yaml (test_async_e2e.py), tiny_distill_cpu.yaml (test_distill.py, with a
# teacher built in the test: the recipe's own teacher takes minutes to train),
# tiny_agent_cpu.yaml (test_agent_gateway.py), smollm2_add_cpu.yaml and
# smollm2_distill_cpu.yaml (test_smollm2_e2e.py; the latter's teacher takes minutes to train),
# smollm2_tool_cpu.yaml and smollm2_agent_cpu.yaml (test_smollm2_e2e.py), tiny_grpo_lora_cpu.yaml
# (test_resume.py; and 100 of its steps in test_lora.py), tiny_grpo_jsonl_cpu.yaml
# (test_data_e2e.py, with malformed rows), serve_smollm2_cpu.yaml (test_service_api.py: it
# starts the Tinker service, not a training run).
ELSEWHERE = {"tiny_tool_cpu.yaml", "tiny_grpo_cpu.yaml", "tiny_ppo_cpu.yaml",
             "tiny_grpo_tp2_cpu.yaml", "tiny_grpo_async_cpu.yaml", "tiny_distill_cpu.yaml",
             "tiny_agent_cpu.yaml", "smollm2_add_cpu.yaml", "smollm2_distill_cpu.yaml",
             "smollm2_tool_cpu.yaml", "smollm2_agent_cpu.yaml", "tiny_grpo_lora_cpu.yaml",
             "tiny_grpo_jsonl_cpu.yaml", "serve_smollm2_cpu.yaml"}
CPU_RECIPES = sorted(p.name for p in (ROOT / "recipes").glob("*_cpu.yaml")
                     if p.name not in ELSEWHERE)


def test_every_cpu_recipe_is_launched_by_some_test():
    """Each recipe kept out of the list below runs in the test named above."""
    tests = {name: (ROOT / "tests" / name).read_text() for name in
             ("test_multi_turn.py", "test_resume.py", "test_tp.py", "test_async_e2e.py",
              "test_distill.py", "test_agent_gateway.py", "test_smollm2_e2e.py",
              "test_data_e2e.py", "test_service_api.py")}
    for recipe in ELSEWHERE - {"tiny_grpo_cpu.yaml"}:  # (RECIPE, in this file)
        assert any(f"recipes/{recipe}" in text for text in tests.values()), recipe
    assert RECIPE == "recipes/tiny_grpo_cpu.yaml"


# two recipes at a time: a launch keeps the 2-core machine only ~70% busy (its ranks wait for
# each other), so a pair takes ~1.6x one launch, not 2x
RECIPE_PAIRS = [CPU_RECIPES[i:i + 2] for i in range(0, len(CPU_RECIPES), 2)]


@pytest.mark.parametrize("recipes", RECIPE_PAIRS, ids=["+".join(p) for p in RECIPE_PAIRS])
def test_every_cpu_recipe_runs_a_few_steps(recipes, tmp_path, cache_dir):
    from llamarl.config import load_config

    procs = {}
    for recipe in recipes:
        cfg = load_config(ROOT / "recipes" / recipe, [])
        n = cfg.trainer.ranks + cfg.generator.engines * cfg.generator.tp
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={n}", "-m", "llamarl.launch", f"recipes/{recipe}",
               "run.steps=2", f"run.output_dir={tmp_path / recipe}",
               "generator.prompts_per_step=8", "data.eval_prompts=16", "run.eval_every=0"]
        procs[recipe] = subprocess.Popen(cmd, cwd=ROOT, env=child_env(LLAMARL_CACHE=cache_dir),
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         text=True)
    try:
        errs = {recipe: proc.communicate(timeout=600)[1] for recipe, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    for recipe, proc in procs.items():
        assert proc.returncode == 0, (recipe, errs[recipe][-3000:])
        (run,) = run_dirs(tmp_path / recipe)
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2], recipe
        assert all(math.isfinite(r["loss"]) for r in rows), recipe


@pytest.mark.parametrize("override, expected", [
    ("run.output_dir=/proc/llamarl-test", "cannot set up the run directory under "
                                          "run.output_dir '/proc/llamarl-test'"),
    ("run.resume=/nonexistent/run", "run.resume '/nonexistent/run' is neither a checkpoint"),
])
def test_setup_failure_on_rank_0_is_one_line_on_every_rank(override, expected):
    t0 = time.monotonic()
    proc = torchrun(3, ["-m", "llamarl.launch", RECIPE, override], timeout=120)
    assert proc.returncode != 0
    assert f"rank 0: error: {expected}" in proc.stderr, proc.stderr[-3000:]
    # the peers stop naming the cause, not "rank 0 died"
    assert f"stopping: rank 0 (trainer 0): {expected[:40]}" in proc.stderr, proc.stderr[-3000:]
    assert "llamarl/runtime/setup.py" not in proc.stderr  # no traceback of ours
    assert time.monotonic() - t0 < 60


def test_a_self_launched_failure_ends_with_llamarls_line_not_torchruns_summary():
    """`python -m llamarl.launch` runs torchrun itself: a failed run's output ends with the
    ranks' one-line causes, without torchrun's ChildFailedError traceback, its summary of
    every rank's exit, or its OMP_NUM_THREADS banner."""
    proc = subprocess.run([sys.executable, "-m", "llamarl.launch", RECIPE,
                           "run.output_dir=/proc/llamarl-test"], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("llamarl: launching 3 local ranks: torchrun --standalone")
    assert all(line.startswith("llamarl: ") for line in lines), proc.stderr[-3000:]
    assert "choose a writable run.output_dir" in lines[-1]
    for noise in ("ChildFailedError", "Traceback", "Root Cause", "OMP_NUM_THREADS", "****"):
        assert noise not in proc.stderr + proc.stdout, noise


def _slurm_rank(rank: int, job: int, port: int, out: Path, cache_dir, steps: int = 2):
    env = child_env(LLAMARL_CACHE=cache_dir, SLURM_PROCID=rank, SLURM_NTASKS=3, SLURM_NNODES=1,
                    SLURM_LOCALID=rank, SLURM_JOB_ID=job, SLURM_JOB_NODELIST="localhost",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    cmd = [sys.executable, "-m", "llamarl.launch", RECIPE, f"run.steps={steps}",
           f"run.output_dir={out}", *SMALL]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_a_port_held_by_another_job_or_program_is_a_one_line_error(tmp_path, cache_dir):
    """Slurm-style launch on a MASTER_PORT that another job's store (or another program)
    holds: every rank of the second job fails in one line within seconds, and the first job
    is left alone (its ranks.jsonl gains nobody). Then the first job is stopped as scancel
    stops one: SIGTERM to every rank, and each says the job was stopped (none names a peer's
    death: rank 0, which hosts the store, waits for the others), exits, and leaves no shared
    memory."""
    import socket
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job_a = [_slurm_rank(r, 1, port, tmp_path / "a", cache_dir, steps=2000) for r in range(3)]
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # every rank of job A is set up (its store is up)
            runs = run_dirs(tmp_path / "a")
            ranks = runs[0] / "ranks.jsonl" if runs else None
            if ranks and ranks.exists() and len(complete_rows(ranks)) == 3:
                break
            assert all(p.poll() is None for p in job_a), job_a[0].communicate()[0][-3000:]
            time.sleep(0.5)
        t0 = time.monotonic()
        job_b = [_slurm_rank(r, 2, port, tmp_path / "b", cache_dir) for r in range(3)]
        outs = [p.communicate(timeout=120)[0] for p in job_b]
        assert time.monotonic() - t0 < 60
        assert all(p.returncode != 0 for p in job_b)
        assert f"cannot host the job's store at 127.0.0.1:{port}" in outs[0], outs[0][-2000:]
        for out in outs[1:]:
            assert "belongs to job 1.0, not to this job (2.0)" in out, out[-2000:]
        (run_a,) = run_dirs(tmp_path / "a")
        assert len((run_a / "ranks.jsonl").read_text().splitlines()) == 3
        assert all(p.poll() is None for p in job_a), "job A goes on"
        deadline = time.monotonic() + 120
        while not (run_a / "metrics.jsonl").exists():  # until job A trains
            assert time.monotonic() < deadline and all(p.poll() is None for p in job_a)
            time.sleep(0.5)
        for p in job_a:
            p.send_signal(signal.SIGTERM)
        outs_a = [p.communicate(timeout=60)[0] for p in job_a]
    finally:
        for p in job_a:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, out in zip(job_a, outs_a):
        assert p.returncode != 0
        # (its own SIGTERM handler, or its watchdog reading a peer's report first: a rank
        # whose main thread is inside a C call runs Python's handler only once it returns)
        assert "the job was stopped" in out, out[-3000:]
        assert not [x for x in out.splitlines() if "llamarl:" in x and "died" in x], out[-3000:]
    assert any("stopped by the launcher (SIGTERM): the job was stopped" in out for out in outs_a)
    assert not list(Path("/dev/shm").glob(f"llamarl_{run_a.name.split('-', 2)[-1]}*"))
    # a program that accepts connections and never answers
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    held = []
    threading.Thread(target=lambda: [held.append(server.accept()) for _ in range(8)],
                     daemon=True).start()
    t0 = time.monotonic()
    proc = _slurm_rank(1, 3, server.getsockname()[1], tmp_path / "c", cache_dir)
    out = proc.communicate(timeout=120)[0]
    server.close()
    assert proc.returncode != 0 and "answers but is not a llamarl job store" in out, out[-2000:]
    assert time.monotonic() - t0 < 60
