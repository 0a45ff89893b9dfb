"""Losing an engine is not losing the job (sync.engine_loss=continue, runtime/roster.py): an
srun-style launch (one process per rank, as Slurm starts them: no agent kills the others) of
1 trainer + 2 engines, engine 1 SIGKILLed mid-run, then replaced with --join."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import ROOT, child_env, complete_rows

RECIPE = "recipes/tiny_grpo_cpu.yaml"
# run.steps is an upper bound: each run is stopped (RUN_DIR/stop) once the replacement has
# been back for BACK_FOR steps, and not before MIN_STEPS (learning is checked over them)
STEPS, KILL_AT, BACK_FOR, MIN_STEPS = 80, 5, 3, 30
CONTINUOUS = ["generator.mode=continuous", "sync.max_staleness=2", "algorithm.correction=aipo"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path: Path, cache_dir, port: int, overrides: list[str], engines: int = 2,
            nodes: int = 1) -> list[subprocess.Popen]:
    procs, ranks = [], 1 + engines
    for rank in range(ranks):
        env = child_env(LLAMARL_CACHE=cache_dir, SLURM_PROCID=rank, SLURM_NTASKS=ranks,
                        SLURM_NNODES=nodes, SLURM_LOCALID=rank % (ranks // nodes),
                        SLURM_JOB_ID=port, SLURM_JOB_NODELIST="localhost",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [sys.executable, "-m", "llamarl.launch", RECIPE, f"run.output_dir={tmp_path}",
               "trainer.ranks=1", f"generator.engines={engines}", f"run.steps={STEPS}",
               "run.eval_every=20", "data.eval_prompts=64", *overrides]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def _wait_for_rows(tmp_path: Path, procs, n: int) -> Path:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        runs = [p for p in tmp_path.iterdir() if p.is_dir()]
        metrics = runs[0] / "metrics.jsonl" if runs else None
        if metrics and metrics.exists() and len(complete_rows(metrics)) >= n:
            return metrics.parent
        if any(p.poll() is not None for p in procs):  # a rank ended before step n
            out = procs[0].stdout.read() if procs[0].stdout else "".join(
                log.read_text() for log in sorted(tmp_path.glob("*.log")))
            raise AssertionError(out[-3000:])
        time.sleep(0.2)
    raise AssertionError(f"the run never reached step {n}")


def _start_replacement(run: Path, cache_dir, stdout) -> subprocess.Popen:
    """`python -m llamarl.launch --join RUN_DIR`, as the runbook says."""
    return subprocess.Popen([sys.executable, "-m", "llamarl.launch", "--join", str(run)],
                            cwd=ROOT, env=child_env(LLAMARL_CACHE=cache_dir), stdout=stdout,
                            stderr=subprocess.STDOUT, text=True)


def _stop_a_replacement_by_hand(run: Path, cache_dir, tmp_path: Path) -> None:
    """Start `--join RUN_DIR` and press Ctrl-C once it says it may be: it leaves alone, and
    the job goes on as it was (still one engine short)."""
    log = tmp_path / "stopped_replacement.log"
    with open(log, "w") as out:
        first = _start_replacement(run, cache_dir, out)
    try:
        deadline = time.monotonic() + 180
        while "stops this replacement alone" not in log.read_text():
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        first.send_signal(signal.SIGINT)
        first.wait(timeout=30)
    finally:
        first.kill()
    text = log.read_text()
    assert first.returncode == 0, text[-3000:]
    assert ("rank 2 (generator 1): stopped (Ctrl-C): this replacement leaves the job, which "
            "goes on without its engine") in text, text[-3000:]


def back_for(run: Path, engines: int, steps: int, min_steps: int = 0) -> bool:
    """Whether metrics.jsonl shows an engine lost and the engines live back at `engines` for
    the last `steps` steps (and at least `min_steps` steps run)."""
    live = [row.get("engines_live") for row in complete_rows(run / "metrics.jsonl")]
    lost = [i for i, n in enumerate(live) if n is not None and n < engines]
    return bool(lost) and len(live) >= max(min_steps, lost[-1] + 1 + steps) and \
        live[-steps:] == [engines] * steps


def _stop_once_back(run: Path, engines: int, min_steps: int = 0) -> None:
    """Touch RUN_DIR/stop, from a thread (the caller reads the ranks' pipes meanwhile), once
    the replacement has been back for BACK_FOR steps (back_for): the run then ends after its
    next step, as at run.steps."""
    def watch() -> None:
        deadline = time.monotonic() + 600
        while not back_for(run, engines, BACK_FOR, min_steps):
            if time.monotonic() > deadline:
                return  # (the run then goes to run.steps, which the test's checks reject)
            time.sleep(0.2)
        (run / "stop").touch()

    threading.Thread(target=watch, daemon=True).start()


def _lose_and_replace(procs, tmp_path: Path, cache_dir, lose, engines: int = 2,
                      min_steps: int = 0, stop_one: bool = False) -> tuple[Path, list[str]]:
    """At step KILL_AT `lose(run)` the last rank (an engine), then start a replacement with
    --join (with `stop_one`, first one that is stopped by Ctrl-C) and stop the run once it
    is back (_stop_once_back); returns the run directory and the outputs of the other ranks
    and the replacement, after checking that they all finished well."""
    joiner = None
    try:
        run = _wait_for_rows(tmp_path, procs, KILL_AT)
        lose(run)
        if stop_one:
            _stop_a_replacement_by_hand(run, cache_dir, tmp_path)
        joiner = _start_replacement(run, cache_dir, subprocess.PIPE)
        _stop_once_back(run, engines, min_steps)
        finishing = (*procs[:-1], joiner)
        outs = [p.communicate(timeout=600)[0] for p in finishing]
    finally:
        for p in (*procs, *([joiner] if joiner else [])):
            p.kill()
    assert [p.returncode for p in finishing] == [0] * len(finishing), "\n".join(outs)[-6000:]
    return run, outs


def _stopped_rows(run: Path, out: str) -> list[dict]:
    """metrics.jsonl of a run stopped by RUN_DIR/stop: steps 1..N, N below run.steps."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert len(rows) < STEPS and f"stopping at step {len(rows)} of {STEPS}" in out, out[-3000:]
    return rows


def _check_loss_and_replacement(run: Path, out: str, engine0: str, trainer: str,
                                replacement: str) -> None:
    """Engine 1 was lost and replaced: engine 0 made slot 1's batches meanwhile and handed it
    back; the run completed every step at the same batch size, within the staleness bound,
    the evaluation went on and the held-out reward still rose over at least MIN_STEPS steps
    (off-policy), and no shared memory was left. (On-policy, where every engine's logprobs
    must be the trainer's: tests/test_tp.py.)"""
    print(*[x for x in out.splitlines() if "slot" in x or "replac" in x], sep="\n")
    assert "rank 2 (generator 1) died" in out and "goes on with 1 of 2 engines" in out, out[-3000:]
    assert "took over slot 1 at batch" in engine0, engine0[-3000:]
    assert "generator 1 (rank 2), replacing the lost engine" in replacement, replacement[-3000:]
    assert "back in the job" in replacement and "took over slot 1 at batch" in replacement
    assert "handed slot 1 back at batch" in engine0
    assert "sending weights to replacement engine 1" in trainer

    rows = _stopped_rows(run, out)
    # every step trained both slots' groups: the batch never changed size
    assert all(sorted(r["behaviour_version_by_engine"]) == ["0", "1"] for r in rows), rows
    assert all(r["staleness_max"] <= 2 and r["dropped_stale"] == 0 for r in rows), rows
    live = [r["engines_live"] for r in rows]
    assert live[0] == 2 and 1 in live and live[-1] == 2, live
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert evals[-1]["step"] == len(rows) and evals[-1]["prompts"] == 64, evals
    assert evals[-1]["reward_mean"] > evals[0]["reward_mean"] + 0.05, evals
    run_id = run.name.split("-", 2)[-1]
    assert not list(Path("/dev/shm").glob(f"llamarl_{run_id}*"))


def test_a_killed_engine_is_dropped_and_a_replacement_takes_its_slot_back(tmp_path, cache_dir):
    """srun-style, continuous generation over the filesystem transport: kill engine 1, and
    engine 0 makes slot 1's batches from where engine 1 stopped, running the groups of both
    slots in one pool, each shipped in its own slot's batches. Then start `python -m
    llamarl.launch --join RUN_DIR` as the runbook says: it gets the current weights and takes
    slot 1 back. The buckets engine 1 never read are swept, and the replacement reads from the
    sync chosen for it. A first replacement, stopped by Ctrl-C, leaves alone. (Batch mode
    over the torch transport, under torchrun: tests/test_tp.py.)"""
    overrides = [*CONTINUOUS, "sync.transport=filesystem"]
    procs = _launch(tmp_path, cache_dir, _free_port(), overrides)

    def lose(run: Path) -> None:
        procs[2].send_signal(signal.SIGKILL)  # global rank 2 = engine 1
        procs[2].wait()
        time.sleep(3)  # the watchdogs declare the loss within a second or two

    run, outs = _lose_and_replace(procs, tmp_path, cache_dir, lose, min_steps=MIN_STEPS,
                                  stop_one=True)
    trainer, engine0, replacement = outs
    # (said by whichever peer's watchdog excuses the engine: the trainer's or engine 0's)
    assert "rank 2 (generator 1) left the job (stopped (Ctrl-C)): the replacement" in "".join(outs)
    _check_loss_and_replacement(run, "\n".join(outs), engine0, trainer, replacement)
    left = list((run / "weight_sync").rglob("*.safetensors"))
    assert len(left) <= 2, left  # (without the sweep: every sync of the loss)


def test_a_lost_node_with_cross_host_channels(tmp_path, cache_dir):
    """Two nodes as the layout sees them (srun-style, 2 tasks per node): node 0 = trainer 0
    and engine 0, node 1 = engines 1 and 2, whose batches cross hosts (dist_channel.py).
    Engine 2 is frozen (SIGSTOP: no process exit, no closed socket, as when a node drops off
    the network) until its heartbeat is missed; engine 0 takes slot 2 over through the
    cross-host channel protocol; a replacement joins and takes it back."""
    procs = _launch(tmp_path, cache_dir, _free_port(),
                    ["generator.prompts_per_step=48", "sync.dead_peer_s=5"], engines=3, nodes=2)

    def lose(run: Path) -> None:
        procs[3].send_signal(signal.SIGSTOP)  # global rank 3 = engine 2, on "node 1"
        _wait_for_loss(run, procs[:3], 3)
        procs[3].kill()
        procs[3].wait()

    run, outs = _lose_and_replace(procs, tmp_path, cache_dir, lose, engines=3)
    out = "\n".join(outs)
    print(*[x for x in out.splitlines() if "slot" in x or "replac" in x or "died" in x
            or "dead" in x], sep="\n")
    assert "rank 3 (generator 2) is dead (no heartbeat" in out, out[-3000:]
    assert "took over slot 2 at batch" in outs[1] and "handed slot 2 back" in outs[1]
    assert "took over slot 2 at batch" in outs[3], outs[3][-3000:]
    rows = _stopped_rows(run, out)
    assert all(sorted(r["behaviour_version_by_engine"]) == ["0", "1", "2"] for r in rows), rows
    assert all(r["policy_version"] - 1 == min(r["behaviour_version_by_engine"].values())
               for r in rows)
    assert all(r["mismatch_kl"] < 1e-4 for r in rows), [r["mismatch_kl"] for r in rows]
    live = [r["engines_live"] for r in rows]
    assert live[0] == 3 and 2 in live and live[-1] == 3, live


def _wait_for_loss(run: Path, procs, engines: int, timeout: float = 120.0) -> None:
    """Until metrics.jsonl counts fewer live engines than `engines`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = (run / "metrics.jsonl").read_text().splitlines()
        if rows and json.loads(rows[-1]).get("engines_live", engines) < engines:
            return
        assert all(p.poll() is None for p in procs)
        time.sleep(0.5)
    raise AssertionError("the loss was never declared")


# Under torchrun, an engine lost and replaced by its supervisor (launch/supervisor.py), on-policy
# over the torch transport: tests/test_tp.py, with engines of tp 2 (both ranks replaced).


# sync.engine_loss=stop: tests/test_roster.py (the job does not survive an engine loss, so no
# engine is excused); a loss that is not excused (there, the last engine's) stops every rank
# with a named error: test_e2e.py, srun-style


def test_join_names_what_is_wrong_in_one_line(tmp_path):
    for run_dir, what in ((tmp_path, "not a run directory of a running job"),):
        proc = subprocess.run([sys.executable, "-m", "llamarl.launch", "--join", str(run_dir)],
                              cwd=ROOT, env=child_env(), capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2 and what in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def _process_tree(pid: int) -> list[int]:
    """`pid` and its descendants."""
    kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [pid] + [p for k in kids.split() for p in _process_tree(int(k))]


def test_a_lost_node_under_two_node_torchrun(tmp_path, cache_dir):
    """Two torchrun agents as on two hosts: node 0 = trainer 0 + engine 0, node 1 = engines
    1 and 2. Node 1 is lost whole (its agent, the engines' supervisors and the engines
    SIGKILLed at once): the batches that crossed hosts from it are made again by engine 0,
    the run completes every step, and rank 0 names the lost node and torchrun's exit barrier,
    which keeps node 0's agent up to 300 s more (so the test stops it)."""
    port, steps = _free_port(), 20
    logs = [tmp_path / f"node{n}.log" for n in range(2)]
    agents = []
    for n in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
               "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               "--rdzv-id=lost-node-test", "--max-restarts=0",
               # node 0 hosts the rendezvous store, as the endpoint's own host would: both
               # agents here match 127.0.0.1, and the first to bind hosted it, so on a loaded
               # machine node 1 could win the race and take the store down with it
               f"--rdzv-conf=is_host={int(n == 0)}", "-m", "llamarl.launch", RECIPE,
               f"run.output_dir={tmp_path}", "trainer.ranks=1", "generator.engines=3",
               "generator.prompts_per_step=48", f"run.steps={steps}", "run.eval_every=10",
               "data.eval_prompts=64"]
        with open(logs[n], "w") as log:
            agents.append(subprocess.Popen(cmd, cwd=ROOT, env=child_env(LLAMARL_CACHE=cache_dir),
                                           stdout=log, stderr=subprocess.STDOUT))
        time.sleep(0.5)
    try:
        run = _wait_for_rows(tmp_path, agents, KILL_AT)
        for pid in _process_tree(agents[1].pid):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 300
        while "the run is complete; the job lost node(s) 1" not in logs[0].read_text():
            assert agents[0].poll() is None and time.monotonic() < deadline, \
                logs[0].read_text()[-4000:]
            time.sleep(0.5)
        while len(_process_tree(agents[0].pid)) > 1:  # its workers end; it waits
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        for a in agents:
            a.kill()
    out = logs[0].read_text()
    assert "rank 2 (generator 1) died" in out and "rank 3 (generator 2) died" in out, out[-3000:]
    assert "goes on with 1 of 3 engines" in out
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(sorted(r["behaviour_version_by_engine"]) == ["0", "1", "2"] for r in rows), rows
    assert rows[0]["engines_live"] == 3 and rows[-1]["engines_live"] == 1
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert evals[-1]["step"] == steps and evals[-1]["prompts"] == 64, evals
    run_id = run.name.split("-", 2)[-1]
    assert not list(Path("/dev/shm").glob(f"llamarl_{run_id}*"))
