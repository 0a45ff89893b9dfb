"""launch/supervisor.py's branches for a tp-1 engine rank under torchrun, with real child
processes and a real job store (the parts of the job a supervisor reads). The end-to-end run,
a tp-2 engine lost and replaced under torchrun, is tests/test_tp.py: there the leader's child
leaves with its killed mate (exit 0); here the child itself dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from llamarl.config import load_config
from llamarl.launch import supervisor
from llamarl.launch.join import ENGINE_ENV
from llamarl.runtime.dist_env import DistEnv
from llamarl.runtime.job_store import job_prefix
from llamarl.runtime.layout import compute_layout
from llamarl.runtime.setup import free_port

KILLED = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
ENDS_WELL = "pass"


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A job store with the run directory set, the supervisor's signal handlers restored
    after the test, and ENGINE_ENV as it was."""
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=10))
    keys = dist.PrefixStore(job_prefix(0), store)
    keys.set("run", json.dumps({"dir": str(tmp_path)}))
    # (set, then deleted, so that monkeypatch restores it as it was, unset included, after
    # supervise sets it directly)
    monkeypatch.setenv(ENGINE_ENV, "")
    monkeypatch.delenv(ENGINE_ENV)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield store, keys
    for s, h in handlers.items():
        signal.signal(s, h)


def supervise(store, monkeypatch, children: list[str]) -> tuple[int, list[list[str]]]:
    """Supervise engine 1 (rank 2 of trainer 0 + two tp-1 engines) whose successive children
    run the Python snippets `children`; returns the exit code for torchrun and the commands
    the supervisor started."""
    cfg = load_config("recipes/tiny_grpo_cpu.yaml",
                      ["trainer.ranks=1", "generator.engines=2", "sync.engine_restarts=1"])
    layout = compute_layout(3, 3, 1, 2, 1)
    env = DistEnv(rank=2, world_size=3, local_rank=2, local_world_size=3,
                  master_addr="127.0.0.1", master_port=store.port, launcher="torchrun")
    started, popen = [], subprocess.Popen

    def child(cmd, **kwargs):
        started.append(cmd)
        assert len(started) <= len(children), f"an unexpected child: {cmd}"
        return popen([sys.executable, "-c", children[len(started) - 1]], **kwargs)

    monkeypatch.setattr(supervisor.subprocess, "Popen", child)
    return supervisor.supervise(["recipes/tiny_grpo_cpu.yaml"], cfg, layout, env), started


def test_a_killed_engine_declared_lost_is_replaced_by_its_supervisor(job, monkeypatch, capfd):
    """The child dies by SIGKILL, the job declares engine 1 lost: the supervisor says so in one
    line and starts `--join RUN_DIR` for its own engine; that replacement ends well, and so
    does the worker."""
    store, keys = job
    keys.set("done/2", "lost")  # (the watchdog that found it dead)
    code, started = supervise(store, monkeypatch, [KILLED, ENDS_WELL])
    assert code == 0
    assert started[0][1:] == ["-m", "llamarl.launch", "recipes/tiny_grpo_cpu.yaml"]
    run = json.loads(keys.get("run"))["dir"]
    assert started[1][1:] == ["-m", "llamarl.launch", "--join", run]
    err = capfd.readouterr().err
    assert ("llamarl: rank 2 (generator 1): its process died (signal 9); the job goes on "
            "without it while a replacement starts (sync.engine_restarts: 0 left)") in err, err
    assert os.environ[ENGINE_ENV] == "1"  # the replacement joins as this engine


def test_a_killed_engine_after_the_trainers_finished_is_not_replaced(job, monkeypatch, capfd):
    """Lost once the trainers are done: no replacement; the worker ends well (torchrun keeps
    the others) and names the command that would replace it."""
    store, keys = job
    keys.set("done/2", "lost")
    keys.set("trainer/final_version", "7")
    code, started = supervise(store, monkeypatch, [KILLED])
    assert code == 0 and len(started) == 1
    err = capfd.readouterr().err
    run = json.loads(keys.get("run"))["dir"]
    assert ("llamarl: rank 2 (generator 1): its process died (signal 9) and the job goes on "
            "without it; this worker ends well so that torchrun keeps the others (replace the "
            f"engine: python -m llamarl.launch --join {run})") in err, err
