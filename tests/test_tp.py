"""Tensor-parallel engines (generator.tp = 2, generator/tp.py) end to end through the launcher:
two tp engines beside two trainer ranks (one lost mid-run and replaced), multi-turn
episodes in continuous mode, and a two-host launch whose engine sits on the other host.
(Weight-sync parity with a tp engine: tests/test_weight_sync.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, child_env, complete_rows, torchrun
from test_async_e2e import SMALL, SOLO, metrics_of, two_host_launch
from test_engine_loss import _wait_for_rows, back_for

pytestmark = pytest.mark.slow
RECIPE = "recipes/tiny_grpo_tp2_cpu.yaml"


def _check_run(out, steps: int, engines: int = 1) -> list[dict]:
    """Every step trained on rollouts of every engine, sampled from the weights the trainer
    sent (the engine's logprobs are the trainer's: both tp ranks hold the right shards)."""
    run, rows = metrics_of(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert set(r["behaviour_version_by_engine"]) == {str(e) for e in range(engines)}
        assert r["dropped_stale"] == 0
    layout = json.loads((run / "layout.json").read_text())
    assert (layout["tp"], layout["engines"]) == (2, engines)
    return rows


# recipes/tiny_grpo_tp2_cpu.yaml's own run (3 steps, held-out evaluation, the follower's
# line): tests/test_file_transport.py (tp2), over the filesystem transport; over the torch
# transport, on-policy: the engine-loss test below.


def test_two_tp2_engines_one_lost_and_replaced(tmp_path, cache_dir):
    """6 ranks on one host: trainers 0-1, engine 0 on ranks 2-3, engine 1 on ranks 4-5,
    on-policy in batch mode over the torch transport, on pair groups (sync.weight_groups
    pairs: one per trainer rank and engine, as a GPU job that can lose an engine uses; the
    shared groups' losses: tests/test_engine_loss.py). At step 3 engine
    1's follower (tp rank 1) is SIGKILLed: its leader leaves the job with it (exit 0), the
    trainers drop the engine once both its ranks are gone and engine 0 makes slot 1's batches.
    Then the supervisor of engine 1's tp rank 0 (launch/supervisor.py: torchrun keeps the job)
    starts a replacement of both ranks, as `--join RUN_DIR` does: it receives resharded
    weights from its first sync and takes slot 1 back. The run completes every step at the
    same batch size, until the test stops it (RUN_DIR/stop: trainer/stop.py) a few steps after
    the replacement is back: both trainer ranks end at the same step, as at run.steps. Every
    engine, the replacement included, samples with the trainer's current weights (the engine's
    and the trainer's logprobs agree), and the held-out evaluation goes on. (Off-policy
    replacement: tests/test_engine_loss.py, srun-style over the filesystem transport.)"""
    # an upper bound: the replacement's start (python, vLLM, two ranks) on 2 cores shared with
    # the job's 4 busy ranks takes 40-60 s, some 150-200 steps of ~0.3 s with one engine left
    steps = 2000
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=6",
           "-m", "llamarl.launch", RECIPE, f"run.steps={steps}", "generator.engines=2",
           SOLO, f"run.output_dir={tmp_path}", *SMALL, "run.eval_every=50",
           "sync.weight_groups=pairs"]
    # a file, not a pipe: nobody reads a pipe while the test waits, and a full one would stall
    # the ranks
    log = open(tmp_path / "job.log", "w+")
    segments = set(Path("/dev/shm").glob("llamarl_*"))  # (vLLM's tp all-reduce too: cpu_fixes)
    job = subprocess.Popen(cmd, cwd=ROOT, env=child_env(LLAMARL_CACHE=cache_dir),
                           stdout=log, stderr=subprocess.STDOUT)
    try:
        run = _wait_for_rows(tmp_path, [job], 3)
        ranks = complete_rows(run / "ranks.jsonl")
        (pid,) = [r["pid"] for r in ranks if r["rank"] == 5]  # engine 1, tp rank 1
        os.kill(pid, signal.SIGKILL)
        _wait_until_back(run, job, then=3)
        (run / "stop").touch()
        job.wait(timeout=300)
    finally:
        job.kill()
        log.close()
    out = (tmp_path / "job.log").read_text()
    assert job.returncode == 0, out[-6000:]
    print(*[x for x in out.splitlines() if "llamarl:" in x or "slot" in x or "replac" in x],
          sep="\n")
    stopped = len((run / "metrics.jsonl").read_text().splitlines())
    assert stopped < steps and f"stopping at step {stopped} of {steps}" in out, out[-3000:]
    assert not (run / "stop").exists()  # (read once: a resume would go on)
    rows = _check_run(tmp_path, stopped, engines=2)  # both slots in every step
    assert all(r["policy_version"] - 1 == min(r["behaviour_version_by_engine"].values())
               for r in rows)
    assert all(r["mismatch_kl"] < 1e-4 for r in rows), [r["mismatch_kl"] for r in rows]
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert evals[-1]["step"] == stopped and evals[-1]["prompts"] == 16, evals
    assert all(rows[-1]["behaviour_version_by_engine"][e] >= 2 for e in ("0", "1"))
    assert "rank 4 (generator 1): rank 5 (generator 1 (tp rank 1)) died" in out, out[-3000:]
    assert ("rank 5 (generator 1 (tp rank 1)) died, and rank 4 (generator 1) left with it: the "
            "job goes on with 1 of 2 engines") in out, out[-3000:]
    assert ("rank 5 (generator 1 (tp rank 1)): its process died (signal 9) and the job goes on "
            "without it; this worker ends well so that torchrun keeps the others (the "
            "supervisor of generator 1's tp rank 0 starts its replacement)") in out, out[-3000:]
    assert ("rank 4 (generator 1): it left the job with its lost engine; the job goes on "
            "without it while a replacement of its 2 ranks starts (sync.engine_restarts: 1 "
            "left)") in out, out[-3000:]
    assert "[generator 0] took over slot 1 at batch" in out, out[-3000:]
    assert "[generator 0] handed slot 1 back at batch" in out, out[-3000:]
    assert "as generator 1 (tp rank 1) (rank 5), replacing the lost engine" in out, out[-3000:]
    assert "back in the job" in out and "[generator 1] took over slot 1 at batch" in out
    assert "[generator 1 (tp rank 1)] followed" in out, out[-3000:]
    assert "sending weights to replacement engine 1" in out
    live = [r["engines_live"] for r in rows]
    assert live[0] == 2 and 1 in live and live[-1] == 2, live
    # the run's, and its engines' (the killed rank's too: its mate removed them as it left)
    assert set(Path("/dev/shm").glob("llamarl_*")) <= segments


def _wait_until_back(run: Path, job: subprocess.Popen, then: int) -> None:
    """Until metrics.jsonl shows the engines live dropping below 2 and back at 2 for `then`
    steps."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert job.poll() is None, "the job ended before the replacement was back"
        if back_for(run, 2, then):
            return
        time.sleep(0.5)
    raise AssertionError("the replacement was not back within 600 s")


def test_multi_turn_episodes_in_continuous_mode_with_tp(tmp_path, cache_dir):
    """recipes/tiny_tool_cpu.yaml with one tp 2 engine in continuous mode: episodes with tool
    calls run across weight loads (a turn may be sampled by two versions), batches carry the
    episode and continuous-generation metrics, and every engine call the leader makes (turns
    submitted one by one, engine steps, pauses for evaluations, weight loads between two
    steps) is made by its other rank too."""
    proc = torchrun(4, ["-m", "llamarl.launch", "recipes/tiny_tool_cpu.yaml", "generator.tp=2",
                        "run.steps=4", "generator.mode=continuous", "sync.max_staleness=2",
                        "algorithm.correction=aipo", "run.eval_every=2", "data.eval_prompts=16",
                        "generator.prompts_per_step=16", f"run.output_dir={tmp_path}"],
                    timeout=900, LLAMARL_CACHE=cache_dir)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = _check_run(tmp_path, 4)
    assert rows[0]["mismatch_kl"] < 1e-4  # sampled from the initial weights, before any load
    for r in rows:
        assert r["turns_per_episode"] >= 1 and r["staleness_max"] <= 2
        assert sum(v for k, v in r.items() if k.startswith("episodes_")) == 16 * 8
        assert 0 < r["engine_busy_share"] <= 1 and 0 <= r["spanning_share"] <= 1
        assert r["in_flight_mean"] > 0
    assert any(r["tool_calls_per_episode"] > 0 for r in rows)
    run, _ = metrics_of(tmp_path)
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2, 4]


def test_two_host_launch_with_a_tp_engine(tmp_path, cache_dir):
    """Two torchrun agents of 2 ranks each on loopback, as on two hosts: the trainer ranks on
    host 0 and the tp 2 engine on host 1, so weights and rollouts cross hosts and the engine's
    own world stays on its host. (The two-host launch of the suite: a tp 1 engine's crossing
    is the same channel and weight group with one receiver rank.)"""
    out = two_host_launch(["-m", "llamarl.launch", RECIPE, "run.steps=2", SOLO,
                           f"run.output_dir={tmp_path}", *SMALL], 2, cache_dir, timeout=900)
    assert "e0t0 over gloo (cross-host)" in out and "e0t1 over gloo (cross-host)" in out, \
        out[-3000:]
    rows = _check_run(tmp_path, 2)
    assert all(r["mismatch_kl"] < 1e-4 for r in rows), "weights did not cross hosts intact"
    run, _ = metrics_of(tmp_path)
    layout = json.loads((run / "layout.json").read_text())
    assert (layout["world_size"], layout["ranks_per_node"]) == (4, 2)
    roles = sorted(json.loads(x)["role"] for x in (run / "ranks.jsonl").read_text().splitlines())
    assert roles == ["generator 0", "generator 0 (tp rank 1)", "trainer 0", "trainer 1"], roles
