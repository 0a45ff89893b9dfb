"""The watchdog reads a few peers' heartbeats a sweep (runtime/watchdog.py: `_window`), not
everyone's: each rank is watched by its WATCHERS nearest live predecessors in rank order, and
what they find reaches the other ranks through the store (`failed`, the roster). The window
by hand-computed cases; then real watchdog threads on one TCPStore, one of them frozen."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from llamarl.runtime.layout import compute_layout
from llamarl.runtime.roster import Roster, started_key
from llamarl.runtime.setup import engine_loss_allowed, engine_loss_excuse, free_port
from llamarl.runtime.watchdog import STALE_S, WATCHERS, Watchdog


def test_the_window_reads_the_nearest_peers_that_move_and_past_those_that_do_not():
    layout = compute_layout(8, 4, 2, 6, 1)  # two nodes of 4 ranks
    dog = Watchdog(lambda: None, 5, layout, 30.0)
    assert WATCHERS == 2 and dog._ring == [6, 7, 0, 1, 2, 3, 4]
    now = 100.0
    # nobody seen moving yet (start-up): as many as a node's ranks past the WATCHERS
    assert dog._window(set(), now) == [6, 7, 0, 1, 2, 3]
    dog._moved = {6: now - 1.0, 7: now - STALE_S}  # both seen moving lately
    assert dog._window(set(), now) == [6, 7]
    dog._moved = {6: now - STALE_S - 0.5, 7: now - 1.0, 0: now - 1.0}  # 6 stopped
    assert dog._window(set(), now) == [6, 7, 0]
    assert dog._window({7}, now) == [6, 0, 1, 2, 3, 4]  # 7 ended: 1 and on never seen
    dog._moved[1] = now
    assert dog._window({7}, now) == [6, 0, 1]
    assert dog._window({6, 7}, now) == [0, 1]
    dog._moved = {2: now}  # 6, 7, 0, 1 stopped (a lost node): read up to the cap
    assert dog._window(set(), now) == [6, 7, 0, 1, 2, 3]
    # the last rank wraps to the first
    last = Watchdog(lambda: None, 7, layout, 30.0)
    last._moved = {0: now, 1: now}
    assert last._window(set(), now) == [0, 1]


class Stopped(Exception):
    """_die ends the watchdog thread here (the real one ends the process)."""


def _dogs(store, layout, dead_after_s, events, **kwargs) -> dict[int, Watchdog]:
    class Dog(Watchdog):
        def _die(self, cause, store, code=1, prefix="", holding=False):
            events.append((self.rank, prefix + cause))
            if store is not None:  # (what the real one records for the peers)
                store.compare_set("failed", "", cause)
            self._stop.set()
            raise Stopped(cause)

    dogs = {}
    for r in range(layout.world_size):
        dog = Dog(lambda: store_client(store), r, layout, dead_after_s, **kwargs)
        dog.host = f"node-{layout.node_of(r)}"  # (emulated hosts: no pid in common)
        dogs[r] = dog
    return dogs


def store_client(server):
    raw = dist.TCPStore("127.0.0.1", server.port, None, False, timeout=timedelta(seconds=10),
                        wait_for_workers=False)
    return dist.PrefixStore("job", raw)


@pytest.fixture
def server():
    return dist.TCPStore("127.0.0.1", free_port(), None, True, timeout=timedelta(seconds=10),
                         wait_for_workers=False)


def _until(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_frozen_rank_is_found_by_its_watchers_and_every_rank_stops_naming_it(server):
    layout = compute_layout(6, 3, 2, 4, 1)  # ranks 0-1 trainers, 2-5 engines; 2 nodes
    events: list[tuple[int, str]] = []
    dogs = _dogs(server, layout, 3.0, events)
    for dog in dogs.values():
        dog.start()
    try:
        time.sleep(2.5)  # (every counter seen moving)
        assert events == []
        dogs[3].stop()  # its heartbeat stops, as in a hung or frozen process
        started = time.monotonic()
        assert _until(lambda: {r for r, _ in events} >= {0, 1, 2, 4, 5}, 15.0), events
        took = time.monotonic() - started
    finally:
        for dog in dogs.values():
            dog.stop()
    found = {r for r, cause in events if cause.startswith("rank 3 (generator 1) is dead")}
    assert found and found <= {1, 2}, events  # its two predecessors read it, nobody else
    assert all("rank 3 (generator 1) is dead (no heartbeat" in cause for _, cause in events)
    assert all(cause.startswith("stopping: ") for r, cause in events if r not in found)
    # dead_after_s, a sweep to see its last move and one to read `failed`, and slack for a
    # loaded machine: well under the window's worst case (STALE_S more per rank passed)
    assert took < 3.0 + 3 * STALE_S, took


def test_a_lost_engine_reaches_every_rank_through_the_roster_and_its_replacement_is_watched(
        server):
    layout = compute_layout(6, 3, 2, 4, 1)
    events: list[tuple[int, str]] = []
    keys = store_client(server)
    for r in range(layout.world_size):  # (lost after start-up: runtime/roster.py started_key)
        keys.set(started_key(r), "1")
    dogs = _dogs(server, layout, 3.0, events, excuse=engine_loss_excuse(layout, True),
                 can_lose=engine_loss_allowed(layout, True))
    lost: dict[int, list[int]] = {r: [] for r in dogs}
    for r, dog in dogs.items():
        dog.on_lost.append(lost[r].append)
        dog.start()
    try:
        time.sleep(2.5)
        dogs[4].stop()  # engine 2
        live = [0, 1, 2, 3, 5]
        assert _until(lambda: all(lost[r] == [2] for r in live), 15.0), (lost, events)
        assert events == []  # the job goes on
        keys = store_client(server)
        assert Roster(keys, layout.engines).read().lost == [2]
        assert all(4 in dogs[r].excused for r in live)
        # a replacement takes rank 4 (runtime/setup.py: joining): watched again by everyone
        keys.delete_key("done/4")
        Roster(keys, layout.engines).note_change()
        assert _until(lambda: all(4 not in dogs[r].excused for r in live), 5.0)
        dogs[4] = _dogs(server, layout, 3.0, events)[4]
        dogs[4].start()
        time.sleep(5.0)  # longer than dead_after_s: it is alive, nobody reports it
        assert events == [] and all(lost[r] == [2] for r in live)
    finally:
        for dog in dogs.values():
            dog.stop()


def test_an_ending_rank_ends_even_while_its_main_thread_holds_the_gil():
    """gloo's ProcessGroup constructor waits for its peers holding the GIL: the watchdog
    thread ending the rank (Watchdog._die) could not get the GIL back to reach os._exit, and
    the rank ran on for sync.timeout_s (seen in tests/test_gpu_path_on_cpu.py). Here the main
    thread holds the GIL in a C sleep of 60 s (ctypes.PyDLL keeps it); the ending thread arms
    _end_within(1) and then needs the GIL: the process ends with exit code 1 in about 1 s."""
    import subprocess
    import sys
    import time

    code = """
import ctypes, threading, time
from llamarl.runtime.watchdog import _end_within
def ending():
    _end_within(1.0)
    time.sleep(0.2)  # (after this it needs the GIL, which the main thread holds)
    print("reached", flush=True)
started = threading.Thread(target=ending)
started.start()
time.sleep(0.1)
ctypes.PyDLL(None).sleep(60)
"""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 1 and time.monotonic() - t0 < 20, proc
    assert "reached" not in proc.stdout
