"""The 8-GPU recipes' default path on the CPU, shrunk to 2 trainer ranks + 2 engines on loopback:
one weight group per (trainer rank, engine) (sync.weight_groups pairs, what `auto` picks on
NCCL with sync.engine_loss=continue on one node), receives ordered sender by sender and
resharding groups as on NCCL (LLAMARL_GLOO_BROADCAST=1), and groups made at their first
operation as NCCL makes communicators (LLAMARL_LAZY_GROUPS=1, parallel/groups.py). Launched
srun-style (one process per rank, no agent to kill the others), the tiny model.

* An engine killed during start-up (before it built its groups with the trainers) stops the
  job within seconds, every rank, with one line (runtime/setup.py: engine_loss_excuse). Before:
  the trainers waited for it in the making of its groups (or, made lazily, in their first
  send) for sync.timeout_s (30 min).
* An engine killed mid-run: the job goes on with the other; a replacement killed after it asked
  for weights and before its first sync is given up (weight_members.py: its join groups'
  making, which before waited for it for sync.timeout_s), and the job goes on.

The 4 + 4 layout itself, with more kills, as a benchmark: not written yet (docs/scaling.md)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT, child_env, complete_rows

RECIPE = "recipes/tiny_grpo_cpu.yaml"
NCCL_SHAPED = {"LLAMARL_GLOO_BROADCAST": "1", "LLAMARL_LAZY_GROUPS": "1"}
TRAINERS, ENGINES = 2, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path: Path, cache_dir, steps: int, extra: tuple[str, ...] = (),
           trainers: int = TRAINERS, engines: int = ENGINES) -> list[subprocess.Popen]:
    """One process per rank, as srun starts them, with the NCCL-shaped groups. Each rank's
    output goes to tmp_path/rank<N>.log (`_log`), not a pipe: a pipe nobody reads until the end
    fills at 64 KiB and blocks the rank that writes to it, and a pipe a rank's child inherited
    stays open after the rank has ended."""
    port, ranks = _free_port(), trainers + engines
    procs = []
    for rank in range(ranks):
        env = child_env(LLAMARL_CACHE=cache_dir, SLURM_PROCID=rank, SLURM_NTASKS=ranks,
                        SLURM_NNODES=1, SLURM_LOCALID=rank, SLURM_JOB_ID=port,
                        SLURM_JOB_NODELIST="localhost", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=port, **NCCL_SHAPED)
        cmd = [sys.executable, "-m", "llamarl.launch", RECIPE, f"run.output_dir={tmp_path}",
               f"trainer.ranks={trainers}", f"generator.engines={engines}",
               "generator.prompts_per_step=8", f"run.steps={steps}", "run.eval_every=0",
               "data.eval_prompts=16", "sync.weight_groups=pairs", "sync.engine_loss=continue",
               "sync.dead_peer_s=10", *extra]
        with open(tmp_path / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, text=True))
        _LOGS[procs[-1].pid] = tmp_path / f"rank{rank}.log"
    return procs


_LOGS: dict[int, Path] = {}  # a rank's process id -> the file its output goes to


def _log(p: subprocess.Popen) -> str:
    return _LOGS[p.pid].read_text(errors="replace")


def _run_dir(tmp_path: Path, timeout: float = 120.0) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = [p for p in tmp_path.iterdir() if p.is_dir()]
        if runs:
            return runs[0]
        time.sleep(0.1)
    raise AssertionError("no run directory")


def _wait_until(what, timeout: float, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        ended = [p for p in procs if p.poll() is not None]
        assert not ended, "a rank ended early:\n" + "\n".join(
            f"--- pid {p.pid} (exit {p.returncode}):\n{_log(p)[-4000:]}" for p in ended)
        time.sleep(0.1)


def _rank_up(run: Path, rank: int) -> bool:
    """Whether `rank` has set up (its watchdog runs): runtime/setup.py writes ranks.jsonl."""
    path = run / "ranks.jsonl"
    return path.exists() and any(json.loads(x)["rank"] == rank
                                 for x in path.read_text().splitlines() if x.strip())


def _finish(procs, timeout: float) -> list[str]:
    """Each process's output once it has ended; a process still running after `timeout`
    fails the test with every live rank's Python stacks (SIGUSR1: launch/__main__.py)."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        live = [p for p in procs if p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGUSR1)
        time.sleep(2.0)
        stacks = "\n".join(f"--- pid {p.pid}:\n{_log(p)[-6000:]}" for p in live)
        raise AssertionError(f"ranks still running after {timeout:.0f} s:\n{stacks}") from None
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return [_log(p) for p in procs]


def test_an_engine_killed_in_start_up_stops_the_job_at_once(tmp_path, cache_dir):
    procs = launch(tmp_path, cache_dir, steps=4)
    engine1 = TRAINERS + 1  # global rank of engine 1
    try:
        run = _run_dir(tmp_path)
        _wait_until(lambda: _rank_up(run, engine1), 120, procs)
        procs[engine1].kill()  # in vLLM's start-up: long before it meets the trainers
        t0 = time.monotonic()
        others = [p for i, p in enumerate(procs) if i != engine1]
        outs = _finish(others, timeout=120)
    finally:
        for p in procs:
            p.kill()
    out = "\n".join(outs)
    assert time.monotonic() - t0 < 60, out[-3000:]
    assert all(p.returncode != 0 for p in others), out[-3000:]
    assert "generator 1 was lost during start-up" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def test_an_engine_and_a_replacement_killed_mid_run_the_job_goes_on(tmp_path, cache_dir):
    steps, kill_at = 200, 3  # (an upper bound: stopped through RUN_DIR/stop below)
    procs = launch(tmp_path, cache_dir, steps=steps)
    engine1 = TRAINERS + 1
    joiner = None
    try:
        run = _run_dir(tmp_path)
        metrics = run / "metrics.jsonl"
        _wait_until(lambda: metrics.exists() and len(complete_rows(metrics)) >= kill_at, 300,
                    procs)
        procs[engine1].send_signal(signal.SIGKILL)
        procs[engine1].wait()
        _wait_until(lambda: complete_rows(metrics)[-1].get("engines_live") == 1, 120,
                    procs[:engine1])
        # a replacement, killed once it has asked the trainers for weights: they were to make
        # a group with it at their next sync
        log = tmp_path / "replacement.log"
        with open(log, "w") as f:
            joiner = subprocess.Popen([sys.executable, "-m", "llamarl.launch", "--join",
                                       str(run)], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                      env=child_env(LLAMARL_CACHE=cache_dir, **NCCL_SHAPED))
        _wait_until(lambda: "asks the trainers for engine 1's weights" in log.read_text(), 180,
                    [*procs[:engine1]])
        assert joiner.poll() is None, log.read_text()[-3000:]
        joiner.kill()
        joiner.wait()
        after = len(complete_rows(metrics))
        _wait_until(lambda: len(complete_rows(metrics)) >= after + 3, 120, procs[:engine1])
        (run / "stop").touch()
        outs = _finish(procs[:engine1], timeout=300)
    finally:
        for p in (*procs, *([joiner] if joiner else [])):
            p.kill()
    out = "\n".join(outs)
    assert [p.returncode for p in procs[:engine1]] == [0] * engine1, out[-4000:]
    rows = complete_rows(metrics)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), out[-3000:]
    assert len(rows) < steps and f"stopping at step {len(rows)} of {steps}" in out, out[-3000:]
    assert rows[-1]["engines_live"] == 1
    assert "goes on with 1 of 2 engines" in out, out[-3000:]
    # the replacement was given up, by the trainers' group making or by the watchdog before
    assert ("was lost before its first sync" in out
            or "the replacement of generator 1 is lost" in out), out[-3000:]
