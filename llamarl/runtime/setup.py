"""What every rank sets up before its role starts: the job store, the run id and directory, the
watchdog. The cross-role groups are described by parallel/plan.py, above this layer; what a
role adds to set-up (the shared-memory sweep, quieting third-party logs) is handed in by
launch/ (`setup`'s `cleanups` and `before_roles`).

The store: under torchrun every rank is a client of the agent's store at MASTER_ADDR:MASTER_PORT
(the store torchrun itself uses; keys live under `llamarl/<restart>/`). Under Slurm or a plain
environment, global rank 0 hosts it there. No `tcp://` rendezvous is used (docs/generator.md).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from llamarl.config import Config
from llamarl.errors import first_line
from llamarl.runtime.dist_env import DistEnv
from llamarl.runtime.gpus import placed_index
from llamarl.runtime.job_store import StoreError, connect_store, job_prefix, open_job_store
from llamarl.runtime.layout import Layout, RankRole
from llamarl.runtime.roster import Roster, started_key
from llamarl.runtime.run_dir import make_run_dir
from llamarl.runtime.watchdog import Watchdog, peek

STARTUP_TIMEOUT_S = 600.0


@dataclass
class Runtime:
    cfg: Config
    layout: Layout
    role: RankRole
    env: DistEnv
    store: dist.Store  # prefixed job store
    prefix: str
    run_id: str
    run_dir: Path
    device: torch.device
    watchdog: Watchdog
    hosts_store: bool = False  # this process serves the job store (Slurm / plain env rank 0)
    joining: str = ""  # a replacement engine (launch/join.py): its incarnation
    # a replacement whose engine rejoined the roster (generator/loop.py: rejoin; set on its
    # leader only, which speaks for the engine)
    back: bool = False
    # what ends the run's leftovers on this host (the shared-memory sweep, handed in by
    # launch/): run by end_of_job and by the watchdog on a failure
    cleanups: list[Callable[[str], None]] = field(default_factory=list)

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    def new_store(self) -> dist.Store:
        """A fresh client connection (threads must not share one)."""
        raw = connect_store(self.env.master_addr, self.env.master_port, self.cfg.sync.timeout_s)
        return dist.PrefixStore(self.prefix, raw)

    def wait_key(self, key: str, timeout_s: float = STARTUP_TIMEOUT_S) -> str:
        """Block until another rank publishes `key` (woken by the store the moment it is set).
        A dead or failed peer ends this process through the watchdog, so no polling here."""
        return wait_for(self.store, key, self.watchdog, timeout_s)

    @property
    def resume(self) -> dict:
        """The checkpoint this job resumes from ({} for a new run): path and its meta.json."""
        return json.loads(self.wait_key("resume"))

    def wait_all_done(self, timeout_s: float) -> bool:
        """Until every rank has ended (`done/<rank>`: ok, or lost); False if some has not
        within `timeout_s` (said in one line)."""
        keys = [f"done/{r}" for r in range(self.layout.world_size)]
        try:
            self.store.wait(keys, timedelta(seconds=timeout_s))
            return True
        except dist.DistError:  # timed out, or the store's host gave up first and left
            try:
                missing = [k for k in keys if not self.store.check([k])]
            except dist.DistError:
                missing = "the store's host"
            print(f"llamarl: rank {self.env.rank} gave up waiting for {missing} to finish",
                  file=sys.stderr)
            return False

    def end_of_job(self) -> None:
        """After this rank has marked itself done. On every node, its local rank 0 waits
        until every rank of the job has ended, then sweeps the node's shared memory of the
        run: what a lost engine left there (vLLM's tp segments of an engine whose ranks were
        all killed) goes with the run, on each host. The store's host (Slurm / plain rank 0)
        must outlive every rank's last store access, so it also waits for the other nodes'
        sweeps. Under torchrun rank 0 names the nodes the job lost (lost_nodes_line)."""
        if self.env.local_rank != 0:
            return
        node = self.layout.node_of(self.env.rank)
        # (the store host waits as long as it always has: a rank that never ends is said)
        if not self.wait_all_done(120.0 if self.hosts_store else STARTUP_TIMEOUT_S):
            return  # ranks of this node may still use their segments
        self.cleanup_shared_memory()
        if not self.hosts_store:
            try:
                self.store.set(f"swept/{node}", "1")
            except dist.DistError:
                pass  # (the store's host gave up waiting and left: the run is complete)
        else:  # the other nodes whose sweeper (first rank) ended well sweep now
            others = [f"swept/{n}" for n in range(self.layout.nodes) if n != node and
                      peek(self.store, f"done/{self.layout.node_ranks(n)[0]}") == b"ok"]
            try:
                self.store.wait(others, timedelta(seconds=30))
            except dist.DistStoreError:
                pass  # (that node's segments stay; the run is complete)
        if self.env.launcher == "torchrun" and self.env.rank == 0:
            line = lost_nodes_line(self.store, self.layout)
            if line:
                print(line, file=sys.stderr, flush=True)

    def cleanup_shared_memory(self) -> None:
        """Run the clean-ups set up with this run (each takes the run id)."""
        for cleanup in self.cleanups:
            cleanup(self.run_id)


def lost_nodes_line(store: dist.Store, layout: Layout) -> str:
    """Under torchrun, once every rank has ended: a line naming the nodes whose ranks the job
    lost, every one (`done/<rank>` = lost: the node is gone, or its engines and their
    replacements all failed), or "". A torchrun agent whose workers all succeeded waits in
    torchrun's exit barrier for the agents of every node, up to 300 s (its
    exit_barrier_timeout, which torchrun's command line cannot set), in a store call that
    Ctrl-C does not interrupt; a lost node's agent never comes (docs/operations.md)."""
    lost = [n for n in range(layout.nodes)
            if all(peek(store, f"done/{r}") == b"lost" for r in layout.node_ranks(n))]
    if not lost:
        return ""
    nodes = ", ".join(str(n) for n in lost)
    return (f"llamarl: the run is complete; the job lost node(s) {nodes}: torchrun's agents "
            "may wait up to 300 s for theirs in torchrun's exit barrier before they exit "
            "(nothing is lost if you kill them now; an srun launch has no such wait)")


def pick_device(env: DistEnv) -> torch.device:
    """This rank's device: the GPU runtime/gpus.py placed it on, else (a process not started
    through llamarl.launch) GPU local_rank of those the node shows, else the CPU."""
    index = placed_index()
    if index is not None:
        return torch.device("cuda", index)
    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def setup(cfg: Config, layout: Layout, env: DistEnv, joining: str = "", *,
          survives_engine_loss: Callable[[torch.device], bool] = lambda device: False,
          cleanups: tuple[Callable[[str], None], ...] = (),
          before_roles: Callable[[], None] = lambda: None) -> Runtime:
    """This rank's Runtime. From the layer above (launch/): `survives_engine_loss(device)`,
    whether the job goes on without a lost engine (parallel/plan.py decides, from the groups
    that span it); `cleanups(run_id)`, what sweeps this run's leftovers on this host;
    `before_roles()`, what must run before a role imports transformers or vLLM."""
    before_roles()
    role = layout.role_of(env.rank)
    prefix = job_prefix(env.restart)
    hosts_store = not env.agent_store and env.rank == 0
    try:
        raw = open_job_store(env, STARTUP_TIMEOUT_S)
    except StoreError as e:
        raise SetupError(str(e)) from None
    store = dist.PrefixStore(prefix, raw)
    device = pick_device(env)

    def make_store():
        if hosts_store:
            return store  # the server's own handle; its lifetime is the process's
        return dist.PrefixStore(prefix, connect_store(env.master_addr, env.master_port,
                                                      cfg.sync.timeout_s))

    survives = survives_engine_loss(device)
    watchdog = Watchdog(make_store, env.rank, layout, cfg.sync.dead_peer_s,
                        excuse=engine_loss_excuse(layout, survives),
                        can_lose=engine_loss_allowed(layout, survives), hosts_store=hosts_store)
    watchdog.start()

    if env.rank == 0:
        try:
            make_run_dir(cfg, layout, env, store, raw)
        except Exception as e:  # a bad output_dir or resume path: one line, for every rank
            what = first_line(e, empty="")
            message = (what if isinstance(e, ValueError) else
                       f"cannot set up the run directory under run.output_dir "
                       f"{cfg.run.output_dir!r} ({type(e).__name__}: {what}): choose a "
                       "writable run.output_dir")
            watchdog.report_failure(message)
            raise SetupError(message) from None
    try:
        rt_info = json.loads(wait_for(store, "run", watchdog))
    except RuntimeError as e:  # rank 0 failed to set up: say its reason, no traceback
        watchdog.stop_now(str(e))
    rt = Runtime(cfg, layout, role, env, store, prefix, rt_info["id"], Path(rt_info["dir"]),
                 device, watchdog, hosts_store, joining, cleanups=list(cleanups))
    if joining:  # a replacement engine (launch/join.py): the peers watch this rank again
        store.delete_key(f"done/{env.rank}")
        store.delete_key(f"left/{env.rank}")  # (the loss line of its predecessor's engine)
        Roster(store, layout.engines).note_change()  # (the watchdogs look: _follow_roster)
    if rt.run_dir.is_dir():  # shared filesystem (always on one host): who runs where
        with open(rt.run_dir / "ranks.jsonl", "a") as f:
            f.write(json.dumps({"rank": env.rank, "role": role.name, "host": socket.gethostname(),
                                "pid": os.getpid(), "device": str(device)}) + "\n")
    watchdog.cleanups.append(rt.cleanup_shared_memory)
    return rt


def engine_loss_allowed(layout: Layout, survives: bool):
    """The watchdog's `can_lose`: whether the job would go on without the engine of dead rank
    `rank` (a generator; another engine live; `survives`: the job survives engine losses at
    all, parallel/plan.py). Reads the roster, changes nothing."""

    def can_lose(store, rank: int) -> bool:
        role = layout.role_of(rank)
        if role.role != "generator" or not survives:
            return False
        return any(e != role.index for e in Roster(store, layout.engines).read().live)

    return can_lose


def engine_loss_excuse(layout: Layout, survives: bool):
    """The watchdog's `excuse`: the engine of a dead generator rank (called once all its ranks
    are gone) is dropped from the roster (its slots go to the live engines) when the job
    survives engine losses (`survives`, parallel/plan.py); the rank that declares the loss
    says so in one line."""

    def excuse(store, rank: int, cause: str) -> bool:
        role = layout.role_of(rank)
        if role.role != "generator" or not survives:
            return False
        roster = Roster(store, layout.engines)
        ranks = layout.engine_global_ranks(role.index)
        if (not store.check([started_key(r) for r in ranks])
                and role.index not in roster.read().lost):
            # lost in start-up: the trainers wait in the making of the groups they share
            # with it (every member must be there), so the job cannot go on without it
            print(f"llamarl: {cause}: generator {role.index} was lost during start-up, before "
                  "it had built its groups with the trainers; the job stops "
                  "(sync.engine_loss=continue goes on without engines lost after start-up): "
                  "launch it again", file=sys.stderr, flush=True)
            return False
        state, replaced = roster.mark_lost(role.index), False
        if state is None:  # another rank's watchdog declared it first, or it was a
            # replacement that died before it was back (it deleted its ranks' marks)
            replaced = roster.lose_replacement(role.index, ranks)
            if replaced is None:  # it rejoined just now: a loss like any other
                state = roster.mark_lost(role.index)
        if state is None:
            if replaced:
                print(f"llamarl: {cause}: the replacement of generator {role.index} is lost "
                      "before it was back in the job (the job goes on as it did)",
                      file=sys.stderr, flush=True)
            for key in (f"join/{role.index}", f"join/{role.index}/claimed"):
                store.delete_key(key)
            roster.note_change()
            return True
        if not state.live:
            return False  # the last engine: the job cannot go on
        for r in ranks:
            store.set(f"done/{r}", "lost")
        roster.note_change()  # (again: the watchdogs that did not find it dead excuse its
        # ranks by these marks, runtime/watchdog.py: _follow_roster)
        moved = [s for s in range(layout.engines) if state.owner[s] != s]  # made by others
        print(f"llamarl: {cause}: the job goes on with {len(state.live)} of {layout.engines} "
              f"engines; "
              + ", ".join(f"generator {state.owner[s]} makes slot {s}" for s in moved)
              + " (sync.engine_loss=continue)", file=sys.stderr, flush=True)
        return True

    return excuse


class SetupError(RuntimeError):
    """Setting up the run failed on this rank; the message is the one line to print."""


def wait_for(store: dist.Store, key: str, watchdog: Watchdog,
             timeout_s: float = STARTUP_TIMEOUT_S) -> str:
    """Block until another rank publishes `key` (woken by the store the moment it is set).
    A dead or failed peer ends this process through the watchdog, so no polling here."""
    watchdog.check()
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except dist.DistStoreError:
        raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for '{key}'") from None
    return store.get(key).decode()


def log(rt_or_role, msg: str) -> None:
    role = rt_or_role.role if isinstance(rt_or_role, Runtime) else rt_or_role
    print(f"[{role.name}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
