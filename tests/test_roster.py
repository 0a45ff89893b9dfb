"""The roster of live engines and slot owners (runtime/roster.py) on a real TCPStore, and the
watchdog's excuse for a lost engine (the job goes on) against its failure for a lost trainer."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from llamarl.config import load_config
from llamarl.parallel.plan import survives_engine_loss
from llamarl.runtime.layout import compute_layout
from llamarl.runtime.roster import Roster, started_key
from llamarl.runtime.setup import engine_loss_excuse, free_port


@pytest.fixture
def store():
    """The job's store, with every rank's start-up mark (runtime/roster.py: started_key): the
    losses here come after start-up (one during it: tests/test_group_making.py)."""
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=10))
    for r in range(16):
        store.set(started_key(r), "1")
    return store


def test_a_lost_engines_slots_go_to_the_least_loaded_live_engines(store):
    roster = Roster(store, 4)
    assert roster.read().owner == [0, 1, 2, 3] and roster.read().live == [0, 1, 2, 3]
    state = roster.mark_lost(2)
    assert state.lost == [2] and state.owner == [0, 1, 0, 3] and state.epoch == 1
    assert roster.mark_lost(2) is None  # declared once, whoever sees it first
    state = roster.mark_lost(0)  # slots 0 and 2 go to 1 and 3, one each
    assert state.owner == [1, 1, 3, 3] and state.live == [1, 3] and state.epoch == 2
    assert roster.read().to_json() == state.to_json()


def test_a_lost_holder_lets_go_and_one_engine_takes_the_slot(store):
    roster = Roster(store, 2)
    assert roster.holder(1) == 1  # never handed over
    roster.mark_lost(1)
    assert roster.holder(1) is None
    assert roster.take(1, 0) and not roster.take(1, 1)
    assert roster.holder(1) == 0
    state = roster.rejoin(1)  # a replacement: its slot comes back once 0 lets go
    assert state.owner == [0, 1] and state.lost == [] and roster.holder(1) == 0
    roster.release(1, 0)
    assert roster.holder(1) is None and roster.take(1, 1)
    with pytest.raises(ValueError, match="not lost"):
        roster.rejoin(1)


def test_concurrent_declarations_assign_once(store):
    """Every rank's watchdog may see the same death; the store lock makes one assignment."""
    host, port = "127.0.0.1", store.port
    results = []

    def declare(engine):
        client = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=10))
        results.append(Roster(client, 3).mark_lost(engine))

    threads = [threading.Thread(target=declare, args=(e,)) for e in (1, 1, 2, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r is not None for r in results) == 2
    state = Roster(store, 3).read()
    assert state.owner == [0, 0, 0] and state.lost == [1, 2] and state.epoch == 2


def _cfg(*overrides):
    return load_config("recipes/tiny_grpo_cpu.yaml", ["generator.engines=2",
                                                      "generator.prompts_per_step=64", *overrides])


def test_which_jobs_survive_an_engine_loss():
    cpu = "gloo"
    layout = compute_layout(4, 4, 2, 2, 1)
    assert survives_engine_loss(_cfg(), layout, cpu)
    assert not survives_engine_loss(_cfg("sync.engine_loss=stop"), layout, cpu)
    # continuous generation too (its slots change hands at batch boundaries as batch mode's)
    assert survives_engine_loss(_cfg("generator.mode=continuous", "sync.max_staleness=2"),
                                layout, cpu)
    assert survives_engine_loss(_cfg("sync.transport=filesystem"), layout, cpu)  # swept
    cuda = "nccl"
    # NCCL: one broadcast group per trainer rank cannot leave an engine out
    assert not survives_engine_loss(_cfg("sync.weight_groups=shared"), layout, cuda)
    # pair groups (sync.weight_groups auto, on one node): a lost engine's are aborted
    assert survives_engine_loss(_cfg(), layout, cuda)
    assert not survives_engine_loss(_cfg(), compute_layout(4, 2, 2, 2, 1), cuda)
    # NCCL with the filesystem transport on one node: nothing NCCL spans an engine
    assert survives_engine_loss(_cfg("sync.transport=filesystem"), layout, cuda)
    # across nodes rollouts take NCCL pair groups
    assert not survives_engine_loss(_cfg("sync.transport=filesystem"),
                                    compute_layout(4, 2, 2, 2, 1), cuda)
    assert not survives_engine_loss(_cfg("generator.engines=1"), compute_layout(3, 3, 2, 1, 1),
                                    cpu)
    # an engine of tp 2 is lost whole (its other rank leaves with it: runtime/watchdog.py)
    assert survives_engine_loss(_cfg("generator.tp=2"), compute_layout(6, 6, 2, 2, 2), cpu)


def test_an_engine_of_two_ranks_is_excused_once_both_are_gone(store, capsys):
    """tp 2: ranks 1-2 are engine 0, ranks 3-4 engine 1. A trainer's watchdog that finds rank
    4 dead waits (pending) until rank 3 is gone too, then drops engine 1 whole; the other rank
    of the dead one's engine leaves the job rather than declare it; with one engine left, a
    loss fails the job."""
    from llamarl.runtime.setup import engine_loss_allowed
    from llamarl.runtime.watchdog import Watchdog

    layout = compute_layout(5, 5, 1, 2, 2)
    cfg = _cfg("generator.tp=2")
    survives = survives_engine_loss(cfg, layout, "gloo")

    def watchdog(rank: int) -> Watchdog:
        return Watchdog(lambda: store, rank, layout, 30.0,
                        excuse=engine_loss_excuse(layout, survives),
                        can_lose=engine_loss_allowed(layout, survives))

    class Ended(Exception):  # leave() and _die() end the process (tests/test_tp.py runs it)
        pass

    def end(how):
        def ending(cause, *_):
            raise Ended(f"{how}: {cause}")
        return ending

    leader = watchdog(1)  # engine 0's leader: its mate is rank 2
    assert leader.mates == {2}
    leader.leave, leader._die = end("left"), end("failed")
    with pytest.raises(Ended, match=r"left: rank 2 \(generator 0 \(tp rank 1\)\) died"):
        leader._fault(2, "rank 2 (generator 0 (tp rank 1)) died", store)
    assert Roster(store, 2).read().lost == []  # the leader leaves, it declares nothing

    trainer = watchdog(0)
    assert trainer.mates == set()
    trainer._fault(4, "rank 4 (generator 1 (tp rank 1)) died", store)
    assert trainer.pending == {4} and Roster(store, 2).read().lost == []
    assert not store.check(["done/4"])  # its leader may still run: its slot stays its own
    store.set("left/3", "1")  # (its leader left with it: Watchdog.leave)
    trainer._fault(3, "rank 3 (generator 1) died", store)
    assert Roster(store, 2).read().lost == [1] and trainer.excused == {3, 4}
    assert trainer.pending == set()
    assert store.get("done/3") == b"lost" and store.get("done/4") == b"lost"
    err = capsys.readouterr().err  # (named by the rank that died first)
    assert ("rank 4 (generator 1 (tp rank 1)) died, and rank 3 (generator 1) left with it: "
            "the job goes on with 1 of 2 engines") in err, err

    with pytest.raises(Ended, match="failed"):  # engine 0 is the last one now: losing it
        leader._fault(2, "rank 2 (generator 0 (tp rank 1)) died", store)  # fails the job


def test_the_filesystem_sweep_keeps_what_a_live_engine_or_a_replacement_may_still_read(
        store, tmp_path, capsys):
    """FileMembers (the filesystem transport with engines that can be lost): live engines
    keep every sync past their read mark; a lost engine keeps nothing; a replacement keeps
    the sync trainer 0 chose for it (its next) until it has read it."""
    from types import SimpleNamespace

    from llamarl.parallel.weight_members import FileMembers

    layout = compute_layout(3, 3, 1, 2, 1)  # rank 0 trainer, ranks 1-2 engines 0-1
    rt = SimpleNamespace(store=store, layout=layout, role=layout.role_of(0))
    members = FileMembers(rt, str(tmp_path))
    (tmp_path / "read.1").write_text("5")  # engine 0 (receiver 1) has read syncs 0-5
    (tmp_path / "read.2").write_text("3")  # engine 1 (receiver 2) had read 0-3
    assert members.begin(8) == 4
    Roster(store, 2).mark_lost(1)
    assert members.begin(8) == 6  # what engine 1 never read goes
    store.set("join/1", "abc")  # a replacement asks to join: it starts at sync 9
    assert members.begin(8) == 6 and store.get("join/1/abc/sync") == b"9"
    assert "sending weights to replacement engine 1 from sync 9" in capsys.readouterr().err
    (tmp_path / "read.1").write_text("10")
    assert members.begin(11) == 9  # kept until the replacement has read it
    (tmp_path / "read.2").write_text("9")
    assert members.begin(12) == 11
    assert store.get("join/1/abc/sync") == b"9"  # chosen once


def test_the_excuse_drops_a_generator_but_never_a_trainer_or_the_last_engine(store, capsys):
    layout = compute_layout(4, 4, 2, 2, 1)  # ranks 0-1 trainers, 2-3 engines 0-1
    excuse = engine_loss_excuse(layout, survives_engine_loss(_cfg(), layout, "gloo"))
    assert not excuse(store, 0, "rank 0 (trainer 0) died")
    assert excuse(store, 3, "rank 3 (generator 1) died (process 7 is gone)")
    assert store.get("done/3") == b"lost"
    err = capsys.readouterr().err
    assert "the job goes on with 1 of 2 engines" in err and "generator 0 makes slot 1" in err
    assert excuse(store, 3, "again")  # already declared: nothing more to say
    assert capsys.readouterr().err == ""
    assert not excuse(store, 2, "rank 2 (generator 0) died")  # the last engine


def test_a_rank_that_ended_well_does_not_keep_its_engine_pending(store):
    """The leader of engine 1 (rank 3) finished (done/3 = ok) and its other rank dies before
    it says so: nothing of engine 1 runs, so it is declared lost at once (its supervisors
    then end well)."""
    from llamarl.runtime.setup import engine_loss_allowed
    from llamarl.runtime.watchdog import Watchdog

    layout = compute_layout(5, 5, 1, 2, 2)
    cfg = _cfg("generator.tp=2")
    survives = survives_engine_loss(cfg, layout, "gloo")
    trainer = Watchdog(lambda: store, 0, layout, 30.0,
                       excuse=engine_loss_excuse(layout, survives),
                       can_lose=engine_loss_allowed(layout, survives))
    store.set("done/3", "ok")
    trainer._fault(4, "rank 4 (generator 1 (tp rank 1)) died", store)
    assert trainer.pending == set() and Roster(store, 2).read().lost == [1]
    assert store.get("done/4") == b"lost"


def test_join_claims_a_lost_engine_once(store, tmp_path, monkeypatch):
    """plan_join (python -m llamarl.launch --join RUN_DIR) against a job store: the first lost
    engine's rank, claimed once; with none lost, a one-line error."""
    import json
    import shutil

    from llamarl.launch.join import plan_join

    (tmp_path / "store.json").write_text(json.dumps(
        {"addr": "127.0.0.1", "port": store.port, "restart": 0, "launcher": "slurm",
         "job": ""}))
    (tmp_path / "layout.json").write_text(json.dumps(
        {"world_size": 4, "trainer_ranks": 2, "engines": 2, "tp": 1, "ranks_per_node": 4}))
    shutil.copy("recipes/tiny_grpo_cpu.yaml", tmp_path / "recipe.yaml")
    overrides = ["generator.engines=2"]
    with pytest.raises(ValueError, match="no engine of this job is lost"):
        plan_join(str(tmp_path), overrides)
    Roster(dist.PrefixStore("llamarl/0", store), 2).mark_lost(1)
    monkeypatch.setenv("LLAMARL_JOIN_ENGINE", "0")  # engine 0's supervisor: 0 is not lost
    with pytest.raises(ValueError, match="no engine of this job is lost"):
        plan_join(str(tmp_path), overrides)
    monkeypatch.setenv("LLAMARL_JOIN_ENGINE", "1")  # engine 1's: its own
    cfg, layout, env, incarnation = plan_join(str(tmp_path), overrides)
    assert env.rank == 3 and layout.role_of(3).index == 1 and incarnation
    monkeypatch.delenv("LLAMARL_JOIN_ENGINE")
    with pytest.raises(ValueError, match="being replaced already"):
        plan_join(str(tmp_path), overrides)
    # tp 2 (engine 1 = ranks 4-5): the process that claims it is its tp rank 0, and the tp
    # ranks it starts (launch/join.py: spawn_tp_ranks) are told their place
    (tmp_path / "layout.json").write_text(json.dumps(
        {"world_size": 6, "trainer_ranks": 2, "engines": 2, "tp": 2, "ranks_per_node": 6}))
    store.delete_key("llamarl/0/join/1/claimed")
    _, layout, env, incarnation = plan_join(str(tmp_path), [*overrides, "generator.tp=2"])
    assert env.rank == 4 and layout.role_of(4).tp_rank == 0
    monkeypatch.setenv("LLAMARL_JOIN_TP_RANK", f"1:{incarnation}:1")
    _, _, env, again = plan_join(str(tmp_path), [*overrides, "generator.tp=2"])
    assert env.rank == 5 and again == incarnation


def test_a_lock_left_by_a_dead_holder_is_broken(store):
    """A rank killed while it held the roster lock must not stop every later change."""
    from llamarl.runtime.roster import LOCK

    store.add(LOCK, 1)  # taken, never given back
    roster = Roster(store, 2)
    t0 = time.monotonic()
    with roster._locked(stale_s=0.3):
        pass
    assert 0.3 <= time.monotonic() - t0 < 5
    assert roster.mark_lost(1).lost == [1]


def test_a_replacement_whose_job_ends_before_it_is_back_ends_well():
    """The job's store goes away (the job ended, or failed) while a replacement (--join) is
    still starting: it ends well with one line, where any other rank fails on a lost store."""
    import subprocess
    import sys

    from llamarl.runtime.job_store import connect_store
    from llamarl.runtime.watchdog import Watchdog

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", (
        "import time; from llamarl.runtime.job_store import connect_store; "
        f"s = connect_store('127.0.0.1', {port}, 30.0, is_master=True); time.sleep(120)")])
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                client = connect_store("127.0.0.1", port, 2.0)
                break
            except Exception:
                assert time.monotonic() < deadline and server.poll() is None
                time.sleep(0.2)
    finally:
        server.kill()
        server.wait()

    class Ended(Exception):
        pass

    def end(how):
        def ending(cause, *_, **options):
            raise Ended(f"{how}: {cause} {options}")
        return ending

    layout = compute_layout(3, 3, 1, 2, 1)  # rank 2: engine 1, the replacement
    for back, expected in ((False, "left: the job's store went away before this replacement "
                                   "was back.*'mark': False"),  # (no new connection)
                           (True, "failed: lost the job's store")):
        watchdog = Watchdog(lambda: client, 2, layout, 30.0)
        watchdog.replacement_not_back = lambda back=back: not back
        watchdog.leave, watchdog._die = end("left"), end("failed")
        watchdog._store = client
        with pytest.raises(Ended, match=expected):
            watchdog._run()  # (the watchdog thread's loop, here in the test's thread)


def test_a_replacement_is_watched_by_its_new_process_not_its_predecessors(store):
    """A watchdog that never excused engine 1 itself (another rank declared the loss and set
    done/<rank>) still holds the dead predecessor's pid. Once a replacement deleted
    done/<rank> and wrote proc/<rank>, that pid being gone is no death: the new process is
    watched instead (a stale pid once declared the replacement lost as it came back)."""
    import json
    import os
    import socket
    import subprocess

    from llamarl.runtime.watchdog import Watchdog

    layout = compute_layout(3, 3, 1, 2, 1)  # rank 0 trainer, ranks 1-2 engines 0-1
    trainer = Watchdog(lambda: store, 0, layout, 30.0)
    predecessor = subprocess.Popen(["true"])
    predecessor.wait()
    trainer._peers_proc[2] = predecessor.pid  # (done/2 was set by another rank, then deleted)
    host = socket.gethostname()
    store.set("proc/2", json.dumps({"host": host, "pid": predecessor.pid}))
    assert trainer._gone_peer(store) == 2  # no replacement: the process is gone, rank 2 died
    store.set("proc/2", json.dumps({"host": host, "pid": os.getpid()}))  # the replacement
    assert trainer._gone_peer(store) is None and trainer._peers_proc[2] == os.getpid()
    assert trainer._running(2, store)


def test_a_replacement_found_dead_before_it_is_back_never_rejoins(store, capsys):
    """The excuse of a replacement's rank found dead and the replacement's rejoin take the
    roster lock in turn: either the replacement is marked lost again first (then it cannot
    rejoin: a slot nobody makes would hang the job), or it rejoined first (then its death is
    a loss like any other)."""
    layout = compute_layout(4, 4, 2, 2, 1)  # ranks 0-1 trainers, 2-3 engines 0-1
    excuse = engine_loss_excuse(layout, survives_engine_loss(_cfg(), layout, "gloo"))
    roster = Roster(store, 2)
    assert excuse(store, 3, "rank 3 (generator 1) died")  # the loss
    capsys.readouterr()

    def claim():  # what a replacement does (launch/join.py, runtime.setup)
        assert store.compare_set("join/1/claimed", "", "abc") == b"abc"
        store.delete_key("done/3")

    claim()
    assert excuse(store, 3, "rank 3 (generator 1) died (process 9 is gone)")
    assert "the replacement of generator 1 is lost before it was back" in capsys.readouterr().err
    assert store.get("done/3") == b"lost" and not store.check(["join/1/claimed"])
    assert roster.rejoin(1, [3]) is None and roster.read().lost == [1]

    claim()  # a second replacement, back before its rank is found dead
    assert roster.rejoin(1, [3]) is not None and roster.read().lost == []
    assert excuse(store, 3, "rank 3 (generator 1) died (process 10 is gone)")
    assert "the job goes on with 1 of 2 engines" in capsys.readouterr().err
    assert roster.read().lost == [1] and store.get("done/3") == b"lost"


def test_peek_reads_a_key_without_waiting_or_setting_it(store):
    """watchdog.peek: a check then a get waited sync.timeout_s for a key deleted in between
    (a replacement deletes its done/<rank> while the others' watchdogs start)."""
    from llamarl.runtime.watchdog import peek

    t0 = time.monotonic()
    assert peek(store, "done/7") is None and not store.check(["done/7"])
    store.set("done/7", "lost")
    assert peek(store, "done/7") == b"lost"
    store.delete_key("done/7")
    assert peek(store, "done/7") is None and time.monotonic() - t0 < 2


def test_a_join_request_withdrawn_while_it_is_read_never_blocks_the_reader(store):
    """join/<e> is deleted when a replacement is lost, at any moment. A reader that checked
    the key and then got it waited when the deletion came in between: TCPStore's get waits
    for a missing key (here 10 s; the launcher's store, much longer), then raises. CI once saw
    a trainer end with an error after a replacement was killed (tests/test_gpu_path_on_cpu.py),
    which that explains. join_request reads in one call that never waits."""
    roster = Roster(store, 2)
    t0 = time.monotonic()
    assert roster.join_request(1) is None
    assert time.monotonic() - t0 < 1.0  # (a get would have waited the store's 10 s)
    store.set("join/1", "abc")
    assert roster.join_request(1) == "abc"
    store.delete_key("join/1")
    assert roster.join_request(1) is None
