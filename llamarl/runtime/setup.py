"""What every rank sets up before its role starts: the job store, the run id and directory, the
watchdog, and descriptions of the cross-role groups.

The store: under torchrun every rank is a client of the agent's store at MASTER_ADDR:MASTER_PORT
(the store torchrun itself uses; keys live under `llamarl/<restart>/`). Under Slurm or a plain
environment, global rank 0 hosts it there. No `tcp://` rendezvous is used (docs/generator.md).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from llamarl.buffer.shm import sweep_run
from llamarl.config import Config, config_to_yaml, reshards
from llamarl.errors import first_line
from llamarl.generator.log_hygiene import quiet_third_party
from llamarl.runtime.dist_env import DistEnv
from llamarl.runtime.gpus import placed_index
from llamarl.runtime.job_store import StoreError, job_identity, job_prefix, open_job_store
from llamarl.runtime.layout import Layout, RankRole
from llamarl.runtime.roster import Roster
from llamarl.runtime.watchdog import Watchdog, peek
from llamarl.parallel.groups import GroupSpec, broadcasts, connect_store, default_backend
from llamarl.parallel.transports.base import TransportSpec

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

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    def new_store(self) -> dist.Store:
        """A fresh client connection (threads must not share one)."""
        raw = connect_store(self.env.master_addr, self.env.master_port, self.cfg.sync.timeout_s)
        return dist.PrefixStore(self.prefix, raw)

    def group_spec(self, name: str, rank: int, size: int) -> GroupSpec:
        return GroupSpec(self.env.master_addr, self.env.master_port, f"{self.prefix}/{name}",
                         rank, size, default_backend(self.device), self.cfg.sync.timeout_s)

    def weight_transport(self, me: int, groups: list[GroupSpec],
                         options: dict | None = None) -> TransportSpec:
        """One end of the weight sync (parallel/transports): trainer rank `me` with its group
        `groups[0]`, or receiver `me` with one group per trainer rank (torch transport).
        `options`: the transport's own (TransportSpec.options)."""
        sync, layout = self.cfg.sync, self.layout
        reshard = reshards(self.cfg)  # (not for adapter-only syncs)
        # filesystem: a directory of this launch's own (run_id is new at every launch, a
        # restart's included), so no run reads the files of another sharing transport_dir
        directory = Path(sync.transport_dir or self.run_dir / "weight_sync") / self.run_id
        tp_groups: list[GroupSpec] = []
        pairs = weight_pairs(self.cfg, layout, self.device)
        if pairs:  # point to point on each pair group (torch_dist.Sender)
            options = {**(options or {}), "pairs": True}
        elif layout.tp > 1 and reshard and broadcasts(default_backend(self.device)):
            # resharded syncs broadcast to one tp rank's receivers: [trainer r, tp rank k of
            # every engine] (gloo sends point to point and needs none)
            n = 1 + layout.engines
            if self.role.role == "trainer":
                tp_groups = [self.group_spec(f"wsync{me}t{k}", 0, n) for k in range(layout.tp)]
            else:
                tp_groups = [self.group_spec(f"wsync{r}t{self.role.tp_rank}",
                                             1 + self.role.index, n)
                             for r in range(layout.trainer_ranks)]
        return TransportSpec(sync.transport, me, layout.trainer_ranks,
                             len(layout.generator_global_ranks), tuple(groups),
                             str(directory), sync.timeout_s, layout.tp, reshard,
                             tuple(tp_groups),
                             (self.env.master_addr, self.env.master_port, self.prefix),
                             options or {})

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
        sweep_run(self.run_id)


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


def setup(cfg: Config, layout: Layout, env: DistEnv, joining: str = "") -> Runtime:
    quiet_third_party()  # before a role imports transformers or vLLM
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

    watchdog = Watchdog(make_store, env.rank, layout, cfg.sync.dead_peer_s,
                        excuse=engine_loss_excuse(cfg, layout, device),
                        can_lose=engine_loss_allowed(cfg, layout, device))
    watchdog.hosts_store = hosts_store
    watchdog.start()

    if env.rank == 0:
        try:
            _make_run_dir(cfg, layout, env, store, raw)
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
                 device, watchdog, hosts_store, joining)
    if joining:  # a replacement engine (launch/join.py): the peers watch this rank again
        store.delete_key(f"done/{env.rank}")
        store.delete_key(f"left/{env.rank}")  # (the loss line of its predecessor's engine)
    if rt.run_dir.is_dir():  # shared filesystem (always on one host): who runs where
        with open(rt.run_dir / "ranks.jsonl", "a") as f:
            f.write(json.dumps({"rank": env.rank, "role": role.name, "host": socket.gethostname(),
                                "pid": os.getpid(), "device": str(device)}) + "\n")
    watchdog.cleanups.append(rt.cleanup_shared_memory)
    return rt


def survives_engine_loss(cfg: Config, layout: Layout, device: torch.device) -> bool:
    """Whether the job goes on when an engine is lost (sync.engine_loss, docs/operations.md):
    another engine must be left, and nothing that spans the lost engine may be a collective
    that cannot leave a member out:

    * gloo (CPU): weight groups whose point-to-point sends can leave a member out
      (sync.transport torch), or the filesystem transport, which waits for no receiver;
      rollouts across hosts go point to point on gloo pair groups too;
    * NCCL (GPU): the filesystem transport on one node. Its weights wait for no receiver and
      its rollouts go through shared memory; across nodes rollouts take NCCL pair groups,
      whose pending operations a lost peer would hold until sync.timeout_s, and the torch
      transport's NCCL broadcast cannot drop a member (docs/operations.md says what is left).

    Batch and continuous generation both hand slots over at batch boundaries
    (generator/slots.py). An engine of tp > 1 is lost whole (runtime/watchdog.py: its other
    ranks leave with a dead one)."""
    if cfg.sync.engine_loss != "continue" or layout.engines < 2:
        return False
    if default_backend(device) == "gloo":
        return cfg.sync.transport in ("torch", "filesystem")
    return layout.nodes == 1 and (cfg.sync.transport == "filesystem"
                                  or weight_pairs(cfg, layout, device))


def weight_pairs(cfg: Config, layout: Layout, device: torch.device) -> bool:
    """Whether the torch transport's weight groups are one per (trainer rank, engine),
    `wsync<r>/pair<e>` = [trainer r, engine e's tp ranks], sent to point to point, rather
    than one per trainer rank with every engine (sync.weight_groups). On NCCL a lost engine's
    pair groups are aborted (trainer/weight_members.py) and the others go on; one broadcast
    group could not leave it out."""
    if cfg.sync.transport != "torch":
        return False
    if cfg.sync.weight_groups != "auto":
        return cfg.sync.weight_groups == "pairs"
    return (default_backend(device) == "nccl" and cfg.sync.engine_loss == "continue"
            and layout.engines >= 2 and layout.nodes == 1)


def pair_group_name(trainer: int, engine: int) -> str:
    """The weight group of trainer rank `trainer` with engine `engine`'s tp ranks
    (weight_pairs; a replacement's is roster.join_group_name)."""
    return f"wsync{trainer}/pair{engine}"


def engine_loss_allowed(cfg: Config, layout: Layout, device: torch.device):
    """The watchdog's `can_lose`: whether the job would go on without the engine of dead rank
    `rank` (a generator; another engine live). Reads the roster, changes nothing."""
    survives = survives_engine_loss(cfg, layout, device)

    def can_lose(store, rank: int) -> bool:
        role = layout.role_of(rank)
        if role.role != "generator" or not survives:
            return False
        return any(e != role.index for e in Roster(store, layout.engines).read().live)

    return can_lose


def engine_loss_excuse(cfg: Config, layout: Layout, device: torch.device):
    """The watchdog's `excuse`: the engine of a dead generator rank (called once all its ranks
    are gone) is dropped from the roster (its slots go to the live engines) when the job
    survives engine losses; the rank that declares the loss says so in one line."""
    survives = survives_engine_loss(cfg, layout, device)

    def excuse(store, rank: int, cause: str) -> bool:
        role = layout.role_of(rank)
        if role.role != "generator" or not survives:
            return False
        roster = Roster(store, layout.engines)
        ranks = layout.engine_global_ranks(role.index)
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
        moved = [s for s in range(layout.engines) if state.owner[s] != s]  # made by others
        print(f"llamarl: {cause}: the job goes on with {len(state.live)} of {layout.engines} "
              f"engines; "
              + ", ".join(f"generator {state.owner[s]} makes slot {s}" for s in moved)
              + " (sync.engine_loss=continue)", file=sys.stderr, flush=True)
        return True

    return excuse


class SetupError(RuntimeError):
    """Setting up the run failed on this rank; the message is the one line to print."""


def _make_run_dir(cfg: Config, layout: Layout, env: DistEnv, store, raw) -> None:
    """Rank 0: the run directory (new, the resumed run's, or after a restart of the job the
    failed attempt's) and its first files, published in the store for every rank."""
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
    resume, run_dir = _resume_point(cfg), None
    if resume is None and not cfg.run.resume and env.restart > 0:
        resume, run_dir = _restart_point(cfg, env, raw)
    if resume is not None:  # continue in the run directory of the checkpoint
        run_dir = resume.parent.parent
        store.set("resume", json.dumps({"checkpoint": str(resume), **json.loads(
            (resume / "meta.json").read_text())}))
    else:
        if run_dir is None:
            run_dir = Path(cfg.run.output_dir).resolve() / f"{cfg.run.name}-{run_id}"
            run_dir.mkdir(parents=True, exist_ok=False)
        store.set("resume", "{}")
        (run_dir / "recipe.yaml").write_text(config_to_yaml(cfg))  # a resume: once loaded
    (run_dir / "layout.json").write_text(json.dumps({
        "world_size": layout.world_size, "trainer_ranks": layout.trainer_ranks,
        "engines": layout.engines, "tp": layout.tp, "launcher": env.launcher,
        "ranks_per_node": layout.ranks_per_node}, indent=1))
    # where a replacement engine finds the job (python -m llamarl.launch --join RUN_DIR)
    (run_dir / "store.json").write_text(json.dumps({
        "addr": env.master_addr, "port": env.master_port, "restart": env.restart,
        "launcher": env.launcher, "job": job_identity()}, indent=1))
    store.set("run", json.dumps({"id": run_id, "dir": str(run_dir)}))


def _restart_point(cfg: Config, env: DistEnv, raw) -> tuple[Path | None, Path | None]:
    """After the launcher restarted the job (torchrun --max-restarts, Slurm requeue): the
    newest complete checkpoint of the failed attempt's run directory and that directory.
    torchrun's agent store outlives the attempts, so the directory is read from the last
    attempt's keys; under Slurm the store is new and the run is found by name."""
    from llamarl.trainer.checkpoint import find_resume, latest
    from llamarl.trainer.metrics import truncate_after

    run_dir = None
    for attempt in range(env.restart - 1, -1, -1):
        key = f"{job_prefix(attempt)}/run"
        if env.agent_store and raw.check([key]):
            run_dir = Path(json.loads(raw.get(key))["dir"])
            break
    found = (latest(run_dir) if run_dir is not None else
             find_resume("auto", Path(cfg.run.output_dir).resolve(), cfg.run.name))
    if found is not None:
        print(f"llamarl: restart {env.restart} of the job: resuming from {found} by itself "
              f"(a checkpoint every run.checkpoint_every = {cfg.run.checkpoint_every} steps)",
              file=sys.stderr, flush=True)
        return _continue_from(found, cfg.run.steps), None
    if run_dir is not None and run_dir.is_dir():
        truncate_after(run_dir, -1)  # nothing to keep: start over in the same directory
        print(f"llamarl: restart {env.restart} of the job: no complete checkpoint yet, "
              f"starting over in {run_dir}", file=sys.stderr, flush=True)
        return None, run_dir
    return None, None


def _resume_point(cfg: Config) -> Path | None:
    if not cfg.run.resume:
        return None
    from llamarl.trainer.checkpoint import find_resume

    found = find_resume(cfg.run.resume, Path(cfg.run.output_dir).resolve(), cfg.run.name)
    if found is None:
        print(f"llamarl: run.resume=auto found no complete checkpoint of '{cfg.run.name}' under "
              f"{cfg.run.output_dir}: starting a new run", file=sys.stderr, flush=True)
        return None
    return _continue_from(found, cfg.run.steps)


def _continue_from(found: Path, steps: int) -> Path:
    """Make the run directory of checkpoint `found` ready to continue from it (up to `steps`,
    run.steps): checked before any file changes and before any rank starts its model."""
    meta = json.loads((found / "meta.json").read_text())
    if meta["policy_version"] >= steps:
        raise ValueError(f"the checkpoint {found} is at step {meta['policy_version']}, already "
                         f"run.steps = {steps}: raise run.steps to continue")
    from llamarl.trainer.checkpoint import remove_partials

    for partial in remove_partials(found.parent.parent):  # the run we continue in
        print(f"llamarl: removed the half-written checkpoint {partial} (a crash left it)",
              file=sys.stderr, flush=True)
    from llamarl.trainer.metrics import truncate_after

    step = meta["step"]
    dropped = truncate_after(found.parent.parent, step)
    if dropped:
        print(f"llamarl: dropped {dropped} metrics/eval row(s) after step {step} from the "
              "crashed launch (they are produced again)", file=sys.stderr, flush=True)
    return found


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
