"""Liveness for the whole job: a dead or failed peer becomes a named error on every rank.

Each rank's watchdog thread bumps its own heartbeat counter in the job store once a second
(`hb/<rank>`; rank 0 creates every counter at start, `hb/ready`) and reads the counters of a
few peers only: those after it in rank order (wrapping around), up to and including the
WATCHERS-th that it has seen move within STALE_S (`_window`). So every rank is watched by its
WATCHERS nearest live predecessors, and the store serves a constant number of keys per rank
a second, ~6 N for N ranks whatever the layout (bench/watchdog_store_load.py; it read N
counters per rank, N^2 keys a second, before). A peer that stops moving makes the window
extend past it (at most `layout.ranks_per_node` more peers: a lost node's ranks are all read
from the same sweep on), so a dead peer's successors stay watched. What one watcher finds
reaches the others through the store: a failure through the `failed` key that every rank
reads each sweep, a lost engine through the roster (`roster/changes`, read each sweep; the
roster when it moved: `_follow_roster`). A rank fails the job
when:
  * a peer wrote a failure report (`report_failure`, on an exception), or
  * a peer on this host has exited (its pid is gone: found within a second, e.g. kill -9), or
  * a peer it watches has a counter that has not moved for `dead_after_s` and the peer did
    not say it is done, or
  * the store itself is unreachable (the launcher agent or rank 0 died).
The thread then prints one line naming the rank and role, runs the cleanup hooks (shared memory)
and ends the process with `os._exit(1)`: the main thread may be blocked inside a collective that
would otherwise wait for its full timeout.

A dead peer that the job can do without (an engine, when others are left: `excuse`, see
runtime/roster.py) is not a failure: it is excused, and watched again if a replacement takes its
rank (its `done/<rank>` key, set to "lost", is deleted then).

An engine of several ranks (generator.tp > 1) is lost whole. Its other ranks (a dead rank's
`mates`, on the same host) leave the job when they find it dead: their watchdog within a second,
or at once when their main thread fails on it (the engine's collectives, the leader's command
stream: `leave_if_mate_lost`); they end well (exit 0) and mark only `left/<rank>`. The other
ranks excuse the engine only once every rank of it is gone (`pending` until then), so a leader
still alive never publishes a batch after its slot was given to another engine. A replacement
(launch/join.py) that fails before it is back leaves too: the job goes on as it did.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

from llamarl.runtime.job_store import peek
from llamarl.runtime.layout import Layout
from llamarl.runtime.roster import CHANGES, Roster

HEARTBEAT_S = 1.0
# each rank is watched by this many of its nearest live predecessors in rank order: one more
# than needed, so a watcher that is slow or dead itself never leaves a rank unwatched
WATCHERS = 2
# a peer whose counter this rank has not seen move for this long does not count as watched:
# the window extends past it (several sweeps: a sweep of a loaded rank can take 2 s)
STALE_S = 3.0 * HEARTBEAT_S
HB_READY = "hb/ready"  # set once rank 0 has created every rank's heartbeat counter
# procs/<host>: one line a process of that host, appended at its start (rank, host, pid);
# procs/<host>/n: how many
PROCS = "procs"
# how long the store's host, ending (a failure, a peer's, or SIGTERM), waits for its peers to
# read why and mark themselves stopped before it ends, and the store with it:
# Watchdog._linger_for_peers
STORE_HOST_LINGER_S = 2.0
# A rank that is ending (Watchdog._die) is made to end within this, whatever its threads do
# (_end_within)
DIE_DEADLINE_S = 10.0


class Watchdog:
    def __init__(self, make_store: Callable[[], object], rank: int, layout: Layout,
                 dead_after_s: float, startup_grace_s: float = 600.0,
                 excuse: Callable[[object, int, str], bool] = lambda store, rank, cause: False,
                 can_lose: Callable[[object, int], bool] = lambda store, rank: False,
                 hosts_store: bool = False):
        self.make_store = make_store  # a fresh client connection for this thread
        self.rank = rank
        self.layout = layout
        self.dead_after_s = dead_after_s
        self.startup_grace_s = startup_grace_s
        self.cleanups: list[Callable[[], None]] = []
        # excuse(store, rank, cause): True when the job goes on without dead peer `rank`
        # (it has then marked it done/<rank> = "lost"); called from the watchdog thread
        self.excuse = excuse
        # can_lose(store, rank): whether the job would go on without dead `rank`'s engine (no
        # side effect; for the ranks of that engine, which leave rather than declare it)
        self.can_lose = can_lose
        self.excused: set[int] = set()
        # on_lost(engine): called from the watchdog thread once this rank has excused a lost
        # engine (parallel/weight_members.py aborts its NCCL pair groups: nothing else would
        # end a send to it before sync.timeout_s)
        self.on_lost: list[Callable[[int], None]] = []
        self.pending: set[int] = set()  # dead ranks of an engine whose other ranks still run
        self._first_cause: dict[int, str] = {}  # why its first rank was found dead, by engine
        me = layout.role_of(rank)
        # the other ranks of this rank's engine (tp > 1): one dead means this one leaves
        self.mates = ({r for r in layout.engine_global_ranks(me.index) if r != rank}
                      if me.role == "generator" else set())
        # run when this process ends either way (processes of its own: reward sandboxes,
        # environment workers); `cleanups` (the run's shared memory) only when the job fails:
        # a rank that leaves a job going on must not touch what the others use
        self.local_cleanups: list[Callable[[], None]] = []
        self._leaving = threading.Lock()
        self._leaving_thread: threading.Thread | None = None
        self._peers_proc: dict[int, int] = {}  # same-host peers: rank -> pid (-1: elsewhere)
        self.host = socket.gethostname()  # (bench/watchdog_store_load.py emulates hosts)
        # the peers in the order this rank watches them: the ones after it, wrapping around
        world = layout.world_size
        self._ring = [r % world for r in range(rank + 1, rank + world)]
        # at most this many peers read a sweep: WATCHERS live ones past a lost node's ranks
        self._most_watched = WATCHERS + layout.ranks_per_node
        # per peer read: (its counter when it last changed, when this rank saw that), and
        # when this rank last saw it move between two of its reads (`_window`)
        self._last: dict[int, tuple[int, float]] = {}
        self._moved: dict[int, float] = {}
        self._procs_seen = -1  # the length of this host's process list when last read
        # a replacement's tp rank 0: the processes of its other tp ranks (launch/join.py). One
        # that ends badly may do so before it could be watched as a peer (its setup)
        self.children: list = []  # [(its rank, its subprocess.Popen)]
        # a replacement: whether it is not back in the job yet (a job that ends, or fails,
        # before then is no failure of the replacement's: it ends well)
        self.replacement_not_back: Callable[[], bool] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # whether this process hosts the job's store (rank 0 without torchrun's agent store:
        # srun), which its peers can no longer read once it has ended
        self.hosts_store = hosts_store  # this process serves the job store (Slurm / plain rank 0)
        # held by whichever path ends this process (_die): the SIGTERM handler takes it before
        # it lingers, so that the watchdog thread, seeing the peers' "job was stopped"
        # reports meanwhile, does not end the process first with a peer's failure
        self._ending = threading.Lock()

    def role_name(self, rank: int) -> str:
        return f"rank {rank} ({self.layout.role_of(rank).name})"

    def start(self) -> None:
        self._store = self.make_store()
        info = {"host": self.host, "pid": os.getpid()}
        self._store.set(f"proc/{self.rank}", json.dumps(info))
        self._store.append(f"{PROCS}/{self.host}", json.dumps({"rank": self.rank, **info})
                           + "\n")
        self._store.add(f"{PROCS}/{self.host}/n", 1)
        self._store.add(f"hb/{self.rank}", 1)
        if self.rank == 0:  # every counter exists from here on: the peers read them in one
            # call (a missing key would make it wait). N calls once, by one rank.
            for r in range(self.layout.world_size):
                self._store.compare_set(f"hb/{r}", "", "0")
            self._store.set(HB_READY, "1")
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._thread = threading.Thread(target=self._run, name="llamarl-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    # -- called by the main thread -------------------------------------------------------
    def report_failure(self, message: str) -> None:
        """Tell every rank why this one is failing (first report wins)."""
        try:
            store = self.make_store()
            store.compare_set("failed", "", f"{self.role_name(self.rank)}: {message}")
            store.set(f"done/{self.rank}", "failed")
        except Exception:  # the store may be gone too; the exit code still tells
            pass

    def stop_now(self, cause: str) -> None:
        """End this process because of a peer's failure `cause` (as the watchdog thread
        does when it sees it first)."""
        self._die(cause, None, prefix="stopping: ")

    def mark_done(self) -> None:
        self._store_main().set(f"done/{self.rank}", "ok")

    def dead_peer(self) -> str | None:
        """Name a peer on this host whose process is gone (the usual root cause when a
        collective fails with 'connection closed'), or None."""
        try:
            store = self._store_main()
            self._local_pids(store, [r for r in range(self.layout.world_size) if r != self.rank])
        except Exception:
            pass
        gone = self._gone_peer(self._store_main())
        if gone is None:
            return None
        return f"{self.role_name(gone)} died (process {self._peers_proc[gone]} is gone)"

    def leave_if_mate_lost(self, wait_s: float = 2.0) -> None:
        """Main thread, failing: if a rank of this rank's engine is dead and the job goes on
        without the engine, leave the job (does not return); else return, and the caller
        fails the job. The engine's collectives and command stream fail at once when a mate's
        process is gone, so its exit is looked for a little (`wait_s`) before giving up."""
        if not self.mates:
            return
        deadline = time.monotonic() + wait_s
        try:
            store = self._store_main()
            if not self.can_lose(store, self.rank):
                return  # (this job cannot go on without this engine, whatever happened)
            while not self._failure_message(store):  # (a peer's failure fails the job)
                self._local_pids(store, sorted(self.mates))
                for r in sorted(self.mates):
                    pid = self._peers_proc.get(r, -1)
                    if pid > 0 and not _alive(pid) and not store.check([f"done/{r}"]):
                        self.leave(f"{self.role_name(r)} died (process {pid} is gone)")
                if time.monotonic() > deadline:
                    return
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 - the store is gone: fail as the caller would
            return

    def leave(self, cause: str, line: str = "its engine is lost, and this rank leaves the job "
                                          "with it (the job goes on)", mark: bool = True) -> None:
        """This rank's engine is lost (`cause`: a mate died) and the job goes on without it:
        say so (`line`) and end the process well. It only marks `left/<rank>` (for the peers'
        line): the peers find this process gone and excuse the engine once all its ranks are."""
        if threading.current_thread() is self._leaving_thread:
            return  # (a signal handler, while this thread was leaving: it goes on leaving)
        with self._leaving:
            self._leaving_thread = threading.current_thread()
            say(f"llamarl: {self.role_name(self.rank)}: {cause}: {line}")
            if mark:  # (the peers' line names the rank that died, not this one). At most 5 s:
                # with the store gone a new connection would retry for sync.timeout_s
                marking = threading.Thread(target=self._mark_left, args=(cause,),
                                           daemon=True)
                marking.start()
                marking.join(5.0)
            for fn in self.local_cleanups:
                try:
                    fn()
                except Exception:
                    pass
            os._exit(0)

    def check(self) -> None:
        """Raise if the job has failed (for waits in the main thread)."""
        msg = self._failure_message(self._store_main())
        if msg:
            raise RuntimeError(msg)

    def _store_main(self):
        if not hasattr(self, "_main_store"):
            self._main_store = self.make_store()
        return self._main_store

    # -- the thread ------------------------------------------------------------------------
    def _failure_message(self, store) -> str | None:
        if store.check(["failed"]):
            msg = store.get("failed").decode()
            return msg or None
        return None

    def _local_pids(self, store, peers: list[int]) -> None:
        """Learn the process of every peer in `peers` that runs on this host and is not known
        yet (its pid; a peer elsewhere stays unknown, as -1 to the readers). Read from this
        host's process list (`procs/<host>`), and only when it has grown: one store key a
        call, and a read of the host's few lines, not of the job's N (each rank reading a
        list of N lines while it grows at start-up made N^2 lines)."""
        n = int(store.add(f"{PROCS}/{self.host}/n", 0))
        if n == self._procs_seen:
            return
        self._procs_seen, wanted = n, set(peers)
        for line in store.get(f"{PROCS}/{self.host}").decode().splitlines():
            info = json.loads(line)
            r = info["rank"]
            if r in wanted and r not in self._peers_proc:
                self._peers_proc[r] = info["pid"]

    def _gone_peer(self, store=None) -> int | None:
        """A same-host peer whose process no longer runs (missing or a zombie) and that did
        not end on its own terms (done, failed with a report, or stopped by the launcher)."""
        for r, pid in list(self._peers_proc.items()):
            if pid > 0 and r not in self.excused | self.pending and not _alive(pid):
                try:
                    if store is not None and store.check([f"done/{r}"]):
                        continue
                    if store is not None and self._replaced(r, pid, store):
                        continue
                except Exception:
                    pass
                return r
        return None

    def _mark_left(self, cause: str) -> None:
        try:
            self.make_store().set(f"left/{self.rank}", cause)
        except Exception:  # noqa: BLE001 - the store is gone: nobody reads the mark
            pass

    def _replaced(self, rank: int, pid: int, store) -> bool:
        """Whether a replacement (launch/join.py) now runs as `rank`, whose process `pid` is
        gone: its `proc/<rank>` names another process (then watched instead). A peer whose
        engine another rank declared lost never had it in `excused` here, so the marks a
        replacement deletes (`done/<rank>`) do not tell this watchdog to forget `pid`."""
        info = json.loads(store.get(f"proc/{rank}"))
        now = info["pid"] if info["host"] == self.host else -1
        if now == pid:
            return False
        self._peers_proc[rank] = now
        return True

    def _on_sigterm(self, signum, frame) -> None:
        # No peer died and none reported a failure: the launcher was told to stop the job
        # (scancel, Ctrl-C or SIGTERM to torchrun), which is not a failure of any rank.
        why, store = "the job was stopped", None
        self._ending.acquire(timeout=STORE_HOST_LINGER_S + 3.0)  # (held: another path is ending it)
        try:
            store = self._store_main()
            store.set(f"done/{self.rank}", "terminated")  # a casualty, not the cause
            if self.hosts_store:
                self._linger_for_peers(store)
            gone = self._gone_peer(store)
            if gone is not None:
                why = f"{self.role_name(gone)} died (process {self._peers_proc[gone]} is gone)"
            elif store.check(["failed"]):
                why = store.get("failed").decode()
        except Exception:
            pass
        self._die(why, store, code=143, prefix="stopped by the launcher (SIGTERM): ",
                  holding=True)

    def linger_if_store_host(self) -> None:
        """Before this process ends on a failure it has reported: if it hosts the store, give
        the peers the time to read the report (`_linger_for_peers`)."""
        if self.hosts_store:
            try:
                self._linger_for_peers(self._store_main())
            except Exception:  # noqa: BLE001 - the store is gone: nobody reads the report
                pass

    def _linger_for_peers(self, store) -> None:
        """The store's host, ending: wait (at most STORE_HOST_LINGER_S) until every peer has
        marked how it ended or is gone. A peer that looked at the store after this process had
        ended would find the store and its host gone, and name this rank's death as the cause:
        of a job that scancel only stopped (it signals every task at once), or that failed
        for a reason this rank had just recorded in the store."""
        peers = [r for r in range(self.layout.world_size) if r != self.rank]
        deadline = time.monotonic() + STORE_HOST_LINGER_S
        while time.monotonic() < deadline:
            pids = dict(self._peers_proc)  # (the watchdog thread may change it meanwhile)
            waiting = [r for r in peers if not store.check([f"done/{r}"])
                       and (pids.get(r, -1) <= 0 or _alive(pids[r]))]
            if not waiting:
                return
            time.sleep(0.05)

    def _run(self) -> None:
        store = self._store
        peers = [r for r in range(self.layout.world_size) if r != self.rank]
        start = time.monotonic()
        try:  # peers lost before this rank started (it may be their replacement's tp rank):
            # watched again once their replacement is back (_follow_roster), not by their
            # old pid. Only the lost engines' ranks are read: N reads by N ranks would be N^2
            self.excused = {r for e in Roster(store, self.layout.engines).read().lost
                            for r in self.layout.engine_global_ranks(e)
                            if r != self.rank and peek(store, f"done/{r}") == b"lost"}
        except Exception:  # noqa: BLE001 - the loop below names a store that is gone
            pass
        ended: set[int] = set()  # peers that ended on their own terms (done/<rank>)
        ready = False  # every heartbeat counter exists (HB_READY)
        changes = None  # the roster's change count when this rank last followed it
        while not self._stop.wait(HEARTBEAT_S):
            try:
                store.add(f"hb/{self.rank}", 1)
                msg = self._failure_message(store)
                if msg:
                    self._die(msg, store, prefix="stopping: ")
                now = time.monotonic()
                moved = int(store.add(CHANGES, 0))
                if moved != changes:  # an engine lost or replaced, by any rank's account
                    changes = moved
                    self._follow_roster(store)
                for r in list(self.pending):  # its engine was declared lost by another rank
                    if store.check([f"done/{r}"]):
                        self.pending.discard(r)
                        self._excuse([r])
                if self.replacement_not_back is not None:
                    self.replacement_not_back()  # (read while the store is there)
                for r, child in self.children:
                    code = child.poll()
                    if code not in (None, 0):
                        msg = self._failure_message(store)  # (raises if the store is gone:
                        if msg:  # it failed as the job ended)
                            self._die(msg, store, prefix="stopping: ")
                        self._fault(r, f"{self.role_name(r)} ended with code {code} (process "
                                       f"{child.pid})", store)
                self._local_pids(store, peers)
                gone = self._gone_peer(store)
                if gone is not None:
                    pid = self._peers_proc[gone]
                    self._fault(gone, f"{self.role_name(gone)} died (process {pid} is gone)",
                                store)
                ready = ready or store.check([HB_READY])
                if not ready:  # rank 0 creates the counters as its watchdog starts
                    if now - start > self.startup_grace_s:
                        self._fault(0, f"{self.role_name(0)} is dead (never started for "
                                       f"{now - start:.0f} s)", store)
                    continue
                window = self._window(self.excused | self.pending | ended, now)
                counts = store.multi_get([f"hb/{r}" for r in window]) if window else []
                for r, value in zip(window, counts):
                    count = int(value)
                    seen, since = self._last.get(r, (-1, now))
                    if count != seen:
                        if seen >= 0:  # (a first read proves nothing)
                            self._moved[r] = now
                        self._last[r] = (count, now)
                        continue
                    limit = self.dead_after_s if count > 0 else self.startup_grace_s
                    if now - since <= limit:
                        continue
                    state = peek(store, f"done/{r}")  # (a peer whose counter stopped)
                    if state == b"lost":  # another rank declared its engine lost: watched
                        self._excuse([r])  # again if a replacement takes the rank
                    elif state is not None:  # it ended on its own terms
                        ended.add(r)
                    else:
                        what = "no heartbeat" if count > 0 else "never started"
                        self._fault(r, f"{self.role_name(r)} is dead ({what} for "
                                       f"{now - since:.0f} s)", store)
            except Exception as e:  # the store is gone: the agent or rank 0 died
                if self._stop.is_set():
                    return
                if time.monotonic() - start < 5:
                    continue
                if self.replacement_not_back is not None and self.replacement_not_back():
                    self.leave("the job's store went away before this replacement was back in "
                               "the job", "the job ended (or failed) without it; this "
                               "replacement ends", mark=False)
                self._die(f"lost the job's store ({type(e).__name__}: {e}); the launcher agent "
                          "or rank 0 died", None)

    def _window(self, skipped: set[int], now: float) -> list[int]:
        """The peers whose counters this rank reads this sweep: the ones after it in rank
        order (wrapping around, `_ring`), less `skipped` (excused, pending or ended), up to
        and including the WATCHERS-th that it saw move within STALE_S, and at most
        `_most_watched`. A peer read for the first time has not been seen to move: the
        window covers a lost node's ranks at once, and at start-up it is that wide for a
        sweep or two. Every live rank is thus read by its WATCHERS nearest live
        predecessors."""
        window: list[int] = []
        fresh = 0
        for r in self._ring:
            if r in skipped:
                continue
            window.append(r)
            moved = self._moved.get(r)
            if moved is not None and now - moved <= STALE_S:
                fresh += 1
            if fresh == WATCHERS or len(window) == self._most_watched:
                break
        return window

    def _follow_roster(self, store) -> None:
        """The roster changed (`roster/changes` moved): take in what other ranks found.
        An excused peer whose `done/<rank>` mark is gone has a replacement: watched again
        (its new process, from a fresh read of its counter). A peer of an engine the roster
        says is lost and marked `done/<rank>` = "lost" is excused (and `on_lost` told once
        all of the engine's ranks are): this rank may not watch it, its watchers found it
        dead. Not this rank's own engine (its ranks leave with it: `leave`)."""
        for r in list(self.excused):
            if not store.check([f"done/{r}"]):
                self.excused.discard(r)
                self._peers_proc.pop(r, None)
                self._procs_seen = -1  # (its replacement's line may be there already)
                self._last.pop(r, None)
                self._moved.pop(r, None)
        for e in Roster(store, self.layout.engines).read().lost:
            ranks = self.layout.engine_global_ranks(e)
            if self.rank in ranks:
                continue
            lost = [r for r in ranks if r not in self.excused
                    and peek(store, f"done/{r}") == b"lost"]
            if lost:
                self.pending -= set(lost)
                self._excuse(lost)

    def _fault(self, rank: int, cause: str, store) -> None:
        """Peer `rank` is dead: go on without it if the job can (excused), else fail. A rank
        of an engine of several: this rank's mate (leave with it), or one of another engine
        whose other ranks still run (pending: excused once they are gone too)."""
        if rank in self.mates:
            if self.can_lose(store, rank):
                self.leave(cause)
            self._die(cause, store)
        role = self.layout.role_of(rank)
        engine = (self.layout.engine_global_ranks(role.index) if role.role == "generator"
                  else [rank])
        running = [r for r in engine if r != rank and self._running(r, store)]
        if running:
            if not self.can_lose(store, rank):
                self._die(cause, store)
            self.pending.add(rank)
            self._first_cause.setdefault(engine[0], cause)
            return
        cause = self._first_cause.pop(engine[0], cause)  # (the rank found dead first)
        marks = {r: peek(store, f"left/{r}") for r in engine}  # (a replacement deletes its
        left = [r for r in engine if marks[r] is not None]  # own: never a waiting get)
        died = [r for r in engine if r not in left]
        if left and not died:  # all left (a replacement stopped by hand): say why
            cause = (" and ".join(self.role_name(r) for r in left) + " left the job ("
                     + marks[left[0]].decode() + ")")
        elif left:  # name the ranks that died, not those that left with them
            cause = (" and ".join(self.role_name(r) for r in died) + " died, and "
                     + " and ".join(self.role_name(r) for r in left) + " left with it")
        if self.excuse(store, rank, cause):
            self.pending -= set(engine)
            self._excuse(engine)
        else:
            self._die(cause, store)

    def _excuse(self, ranks: list[int]) -> None:
        """Go on without these generator ranks; once all of an engine's are excused, tell
        `on_lost` (in this thread)."""
        self.excused.update(ranks)
        engines = {self.layout.role_of(r).index for r in ranks
                   if self.layout.role_of(r).role == "generator"}
        for e in engines:
            if set(self.layout.engine_global_ranks(e)) <= self.excused:
                for fn in self.on_lost:
                    try:
                        fn(e)
                    except Exception as err:  # noqa: BLE001 - one line; the job goes on
                        print(f"llamarl: rank {self.rank}: after generator {e} was lost: "
                              f"{type(err).__name__}: {err}", file=sys.stderr, flush=True)

    def _running(self, rank: int, store) -> bool:
        """Whether peer `rank` may still run: not found dead, not ended (done/<rank>), and not
        a same-host process that is gone."""
        if rank in self.pending | self.excused or store.check([f"done/{rank}"]):
            return False
        pid = self._peers_proc.get(rank, -1)
        return pid <= 0 or _alive(pid) or self._replaced(rank, pid, store)

    def _die(self, cause: str, store, code: int = 1, prefix: str = "",
             holding: bool = False) -> None:
        """Say `cause`, record it for the peers (first report wins), clean up, end the
        process. The line goes out first: once the peers read the report they exit, and
        torchrun then kills this process within its 0.1 s monitor interval. One caller at a
        time (`_ending`; `holding`: the caller has it): a second waits, and the process ends
        before it gets it."""
        if not holding:
            self._ending.acquire()
        say(f"llamarl: {self.role_name(self.rank)}: {prefix}{cause}")
        _end_within(DIE_DEADLINE_S)
        if store is not None:
            try:
                store.compare_set("failed", "", cause)
                store.set(f"done/{self.rank}", "stopped")
                if self.hosts_store and not holding:  # (the SIGTERM handler has waited)
                    self._linger_for_peers(store)
            except Exception:
                pass
        for fn in (*self.local_cleanups, *self.cleanups):
            try:
                fn()
            except Exception:
                pass
        os._exit(code)


def _end_within(seconds: float) -> None:
    """End this process (exit code 1) in `seconds` unless it has ended by then, by a C thread
    that needs no GIL (faulthandler's timer; its stack dump goes nowhere). The main thread may
    be blocked in a C++ call that holds the GIL: gloo's ProcessGroup constructor waits for its
    peers holding it, so a trainer making its group when a peer died was stuck there, and the
    watchdog thread, back from one store call, never got the GIL again to reach os._exit
    (tests/test_gpu_path_on_cpu.py saw rank 0 print its stop line and run on for the gloo
    timeout, sync.timeout_s)."""
    devnull = open(os.devnull, "w")  # noqa: SIM115 - faulthandler holds it until it fires
    faulthandler.dump_traceback_later(seconds, exit=True, file=devnull)


def store_keys_per_sweep() -> int:
    """Store keys one rank's sweep touches once every rank runs (one sweep a HEARTBEAT_S): its
    heartbeat (add), the failure key (check), the roster's change count (add), its host's
    process-list length (add) and WATCHERS heartbeat counters (one multi_get). Independent of
    the job's size; bench/watchdog_store_load.py measures ~6 a rank a second at 64-1024
    ranks, and the paper launch (tests/test_paper_launch.py) budgets with this."""
    return 4 + WATCHERS


def say(line: str) -> None:
    """Write `line` to stderr in one write(2): a process's last line. The ranks of a node
    share the launcher's stderr, and one write of a line (under PIPE_BUF, 4 KiB) reaches a
    pipe whole, never split by another rank's output. It bypasses sys.stderr's buffer, so
    the SIGTERM handler may say it while this thread was inside a print (the buffered
    stream would raise 'reentrant call' there and the line would be lost); a partial line
    still in that buffer stays there (the process ends with os._exit)."""
    data = (line + "\n").encode(errors="replace")
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # (a captured stream: in-process tests)
        print(line, file=sys.stderr, flush=True)
        return
    try:
        os.write(fd, data)
    except OSError:  # stderr is gone (a closed pipe): the exit code still tells
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return True
