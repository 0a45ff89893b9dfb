"""Who receives trainer rank r's weight syncs when engines can be lost and replaced
(runtime/roster.py; gloo point to point, see parallel/transports/torch_dist.py).

The engines of the launch receive on the group built at start-up, wsync<r> = [trainer r, every
generator rank]: a lost one is left out of every later sync. A replacement engine
(`python -m llamarl.launch --join RUN_DIR`) is a new process (tp of them for an engine of
tp > 1), which cannot enter that group: it gets a group of its own with each trainer rank,
`wsync<r>/join<e>.<n>` = [trainer r, its tp ranks] (engine e, replacement n). Every trainer
rank must start sending to it at the same sync, so trainer 0 picks that sync (its next one) and
writes it in `join/<e>/<n>/sync`; every trainer rank reads the choice before its own sync of
that number (the trainers are in lockstep: rank r cannot start sync i + 1 before trainer 0 has
finished sync i). The replacement builds its groups as
soon as it reads the choice, and the trainers theirs at that sync.

With the filesystem transport nobody waits for a receiver, so a lost engine cannot hang a sync;
what it leaves behind are the files it never acked. FileMembers tells the sender which syncs
every live engine, and every replacement about to start, has read (parallel/transports/
filesystem.py), and trainer 0 picks a replacement's first sync the same way.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from llamarl.parallel.groups import job_group_spec, make_group
from llamarl.parallel.plan import join_group_name
from llamarl.parallel.transports.filesystem import read_mark
from llamarl.parallel.transports.torch_dist import Members
from llamarl.runtime.roster import Roster
from llamarl.runtime.setup import Runtime, log


def replacement_start(rt: Runtime, e: int, n: str, sync: int) -> int | None:
    """The first sync replacement n of engine e receives, read at trainer sync `sync`:
    trainer 0 chooses its next one, the other trainer ranks read the choice (None before it
    is made)."""
    store, key = rt.store, f"join/{e}/{n}/sync"
    if rt.role.index == 0:
        store.compare_set(key, "", str(sync + 1))
    return int(store.get(key)) if store.check([key]) else None


class EngineMembers(Members):
    """`group`: the sender's group with every engine (wsync<r>); or `pair_groups`, one per
    engine (sync.weight_groups pairs: [trainer r, engine e's tp ranks]), of which a lost
    engine's is aborted the moment this rank's watchdog excuses it (NCCL: a send to it would
    otherwise hold this rank's GPU stream until sync.timeout_s)."""

    def __init__(self, rt: Runtime, group: dist.ProcessGroup | None,
                 pair_groups: list[dist.ProcessGroup] | None = None):
        self.rt, self.group = rt, group
        self.pair_groups = pair_groups
        self.aborted: set[int] = set()  # ids of the groups aborted
        self.roster = Roster(rt.store, rt.layout.engines)
        # engine e's ranks in the group (one per tp rank: each receives its own copy)
        self.receivers = _receivers(rt)
        if pair_groups is not None:  # its tp ranks are ranks 1 .. tp of its own group
            self.receivers = {e: [1 + k for k in range(rt.layout.tp)]
                              for e in range(rt.layout.engines)}
            rt.watchdog.on_lost.append(self.abort_engine)
        self.pairs: dict[int, tuple[str, dist.ProcessGroup]] = {}  # engine -> (n, its group)
        self.syncs = 0  # syncs sent so far: the index of the next one
        self._joining: set[int] = set()  # replacements that receive but are not back yet
        # what the roster and the join requests said when `roster.changes()` was _seen: read
        # again only when it moves, so a sync costs one store round trip in steady state
        self._seen: int | None = None
        self.state = self.roster.read()
        self._requests: dict[int, str] = {}  # engine -> replacement asking to join

    def targets(self) -> list[tuple[int, dist.ProcessGroup, int]]:
        """Called once per sync, in the same order on every trainer rank."""
        i, self.syncs = self.syncs, self.syncs + 1
        changes = self.roster.changes()
        if changes != self._seen:
            self._seen, self.state = changes, self.roster.read()
            requests = {e: self.roster.join_request(e) for e in range(self.rt.layout.engines)}
            self._requests = {e: n for e, n in requests.items() if n is not None}
        lost = set(self.state.lost)
        out, joining = [], set()
        for e in range(self.rt.layout.engines):
            pair = self._replacement(e, self._requests[e], i) if e in self._requests else None
            if pair is not None:  # its tp ranks: group ranks 1..tp
                out += [(e, pair, 1 + k) for k in range(self.rt.layout.tp)]
                joining.add(e)
            elif e not in lost:
                group = self.group if self.pair_groups is None else self.pair_groups[e]
                out += [(e, group, dst) for dst in self.receivers[e]]
        self._joining = joining & lost
        return out

    def lost(self) -> set[int]:
        """Engines declared lost, except replacements already receiving (their sends must be
        waited for like any other)."""
        store = self.rt.store  # a replacement that died before it was back: lost again
        return {e for e in self.roster.read().lost
                if e not in self._joining or not store.check([f"join/{e}"])}

    def abort_engine(self, e: int) -> None:
        """Engine e is lost (the watchdog's thread): abort its NCCL pair groups, the job's and
        a replacement's, so that sends to it end (with an error, forgiven since e is lost)
        instead of holding this rank's GPU. Gloo needs none: a send to a dead peer fails, or is
        abandoned (WeightSender._abandon_lost)."""
        groups = [] if self.pair_groups is None else [self.pair_groups[e]]
        if e in self.pairs:
            groups.append(self.pairs[e][1])
        for group in groups:
            if group.name() == "nccl" and id(group) not in self.aborted:
                self.aborted.add(id(group))
                group.abort()
                log(self.rt, f"aborted the weight group of lost engine {e}")

    def _replacement(self, e: int, n: str, i: int) -> dist.ProcessGroup | None:
        """The group of replacement n of engine e if it receives sync i, building it at its
        first."""
        if self.pairs.get(e, ("",))[0] == n:
            return self.pairs[e][1]
        start = replacement_start(self.rt, e, n, i)
        if start is None or start > i:
            return None
        spec = job_group_spec(self.rt, join_group_name(self.rt.role.index, e, n), 0,
                              1 + self.rt.layout.tp)

        def gone() -> bool:  # lost before it built its end (its join request is withdrawn)
            return self.roster.join_request(e) != n

        group = make_group(spec, give_up=gone)  # a rendezvous with the replacement
        if group is None:
            log(self.rt, f"replacement {n} of engine {e} was lost before its first sync: "
                         "no weights go to it (the job goes on as it did)")
            self._requests.pop(e, None)
            return None
        self.pairs[e] = (n, group)
        if self.rt.role.index == 0:
            log(self.rt, f"sending weights to replacement engine {e} from sync {i}")
        return self.pairs[e][1]


class FileMembers:
    """The filesystem transport's sweep (filesystem.SweepMembers) for trainer rank r's syncs."""

    def __init__(self, rt: Runtime, directory: str):
        self.rt, self.directory = rt, Path(directory)
        self.roster = Roster(rt.store, rt.layout.engines)
        self.receivers = _receivers(rt)

    def begin(self, sync: int) -> int:
        """Called at every sync: trainer 0 gives each replacement asking to join its first
        sync (the next one); returns the first sync a live engine (past its read mark) or a
        replacement (from its first sync, until it has read it) may still read."""
        lost = set(self.roster.read().lost)
        first = sync
        for e, receivers in self.receivers.items():
            mark = min(read_mark(self.directory, j) for j in receivers)
            if e not in lost:
                first = min(first, mark + 1)
                continue
            n = self.roster.join_request(e)
            if n is None:
                continue  # lost, no replacement: what it did not read goes
            start = replacement_start(self.rt, e, n, sync)
            if start is None:
                continue
            if self.rt.role.index == 0 and start == sync + 1:  # chosen just now
                log(self.rt.role, f"sending weights to replacement engine {e} from sync "
                                  f"{start}")
            if mark < start:  # (a mark at or past it is the replacement's own)
                first = min(first, start)
        return first


def _receivers(rt: Runtime) -> dict[int, list[int]]:
    """Engine e -> the receiver numbers of its ranks (1 + its place among the generator ranks:
    the group rank in wsync<r>, the receiver number of the filesystem transport)."""
    gen = rt.layout.generator_global_ranks
    return {e: [1 + gen.index(r) for r in rt.layout.engine_global_ranks(e)]
            for e in range(rt.layout.engines)}
