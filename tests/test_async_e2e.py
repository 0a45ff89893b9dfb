"""The asynchronous pipeline end to end: several engines and trainer ranks with bounded
staleness. two_host_launch: as on two hosts (its launch: tests/test_tp.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, child_env, torchrun

pytestmark = pytest.mark.slow
RECIPE = "recipes/tiny_grpo_cpu.yaml"
SMALL = ["generator.prompts_per_step=8", "data.eval_prompts=16", "run.eval_every=0"]
# The tiny model's weight matrices (>= 16 KiB) travel alone: broadcast straight from the
# trainer's parameters (the next optimizer step waits for them) into the engine's.
SOLO = "sync.solo_mb=0.015625"


def metrics_of(out: Path) -> tuple[Path, list[dict]]:
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return run, [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_engines_two_trainers_async_with_aipo(tmp_path, cache_dir):
    proc = torchrun(4, ["-m", "llamarl.launch", RECIPE, "run.steps=5", "generator.engines=2",
                        "sync.max_staleness=1", "algorithm.correction=aipo", SOLO,
                        f"run.output_dir={tmp_path}", *SMALL],
                    timeout=600, LLAMARL_CACHE=cache_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run, rows = metrics_of(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for r in rows:
        assert r["staleness_max"] <= 1 and r["dropped_stale"] == 0
        # every step holds rollouts of both engines, each from weights at most 1 version old
        versions = {int(k): v for k, v in r["behaviour_version_by_engine"].items()}
        assert set(versions) == {0, 1}
        assert all(r["policy_version"] - 1 - v <= 1 for v in versions.values())
    # both engines follow the weight updates: their behaviour versions advance
    assert all(rows[-1]["behaviour_version_by_engine"][e] >= 3 for e in ("0", "1"))
    assert rows[-1]["tokens_generated"] > 0
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 5]


def two_host_launch(args: list[str], per_node: int, cache_dir, timeout: float = 600) -> str:
    """Two torchrun agents of `per_node` ranks each on loopback, as on two hosts; returns
    their output once both succeeded."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agents = []
    for _ in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
               f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-host-test",
               "--max-restarts=0", *args]
        agents.append(subprocess.Popen(cmd, cwd=ROOT, env=child_env(LLAMARL_CACHE=cache_dir),
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True))
        time.sleep(0.5)
    try:
        outs = [a.communicate(timeout=timeout)[0] for a in agents]
    finally:
        for a in agents:
            a.kill()
    out = "\n".join(outs)
    assert all(a.returncode == 0 for a in agents), out[-5000:]
    return out


def test_deterministic_async_runs_are_reproducible(tmp_path, cache_dir):
    """sync.deterministic: batch b is sampled from the first version >= b - k whatever the
    timing, so two async runs with one seed give identical metrics (timings aside)."""
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        proc = torchrun(2, ["-m", "llamarl.launch", "recipes/tiny_grpo_async_cpu.yaml",
                            "run.steps=8", "sync.deterministic=true", f"run.output_dir={out}",
                            *SMALL], timeout=600, LLAMARL_CACHE=cache_dir)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs.append(metrics_of(out)[1])
    keys = ("reward_mean", "loss", "grad_norm", "batch_digest", "staleness_mean",
            "behaviour_version_by_engine", "mismatch_kl", "entropy")
    assert [[r[k] for k in keys] for r in runs[0]] == [[r[k] for k in keys] for r in runs[1]]
    assert [r["staleness_mean"] for r in runs[0]] == [0.0] + [1.0] * 7  # exactly k = 1 old
