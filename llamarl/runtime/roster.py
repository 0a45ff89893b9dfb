"""Which engines are alive and which engine makes each slot's rollout batches.

The prompts and batches of a run are divided into E *slots*, one per engine of the recipe:
slot s owns prompt shard s, the held-out shard s, its sampling seeds and the channels
`e<s>t<r>` to every trainer rank r. Normally engine s makes slot s. When an engine is lost
(its process is gone, or its node: see runtime/watchdog.py) its slots go to the live engine
with the fewest slots, which makes them from the next batch they owe, with the same prompts
in the same order and the same seeds: the trainers see the same batch size and read the
same channels, and nothing the lost engine had delivered is made again (generator/slots.py).
A replacement engine (`python -m llamarl.launch --join RUN_DIR`) takes its slot back.

The state is one JSON value in the job store (`roster`), changed under a store lock; every
change bumps its `epoch`, which names the weight groups built for the engines alive then
(parallel/weight_members.py). A slot is made by one engine at a time: `slot/<s>/holder` names
it, and is cleared when the holder is lost or hands the slot over.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from llamarl.runtime.job_store import peek

KEY = "roster"
LOCK = "roster/lock"
# bumped by every roster change and every replacement's request to join: a reader on a hot
# path (each weight sync) caches what it read and reads again only when this moved
CHANGES = "roster/changes"
LOCK_STALE_S = 10.0  # a roster lock held this long belongs to a process that died holding it


@dataclass
class RosterState:
    engines: int  # slots = the recipe's generator.engines
    epoch: int = 0  # bumped on every change
    lost: list[int] = field(default_factory=list)  # engines lost (not rejoined)
    owner: list[int] = field(default_factory=list)  # owner[s]: the engine that makes slot s

    def __post_init__(self):
        if not self.owner:
            self.owner = list(range(self.engines))

    @property
    def live(self) -> list[int]:
        return [e for e in range(self.engines) if e not in self.lost]

    def slots_of(self, engine: int) -> list[int]:
        return [s for s, o in enumerate(self.owner) if o == engine]

    def to_json(self) -> str:
        return json.dumps({"engines": self.engines, "epoch": self.epoch, "lost": self.lost,
                           "owner": self.owner})

    @classmethod
    def from_json(cls, text: str | bytes) -> RosterState:
        return cls(**json.loads(text))


class Roster:
    """The job's roster in `store` (a job store client; use one per thread)."""

    def __init__(self, store, engines: int):
        self.store = store
        self.engines = engines

    def read(self) -> RosterState:
        if not self.store.check([KEY]):
            return RosterState(self.engines)
        return RosterState.from_json(self.store.get(KEY))

    def join_request(self, engine: int) -> str | None:
        """The replacement asking to join as `engine` (`join/<engine>`), or None: one store
        call that never waits (the key is deleted when the engine or its replacement is
        lost, and a check then a get would wait forever for a key deleted in between)."""
        value = peek(self.store, f"join/{engine}")
        return None if value is None else value.decode()

    def changes(self) -> int:
        """How many times the roster or the join requests changed (one store round trip)."""
        return self.store.add(CHANGES, 0)

    def note_change(self) -> None:
        """A change outside the roster value that its cached readers must see (a join
        request, one withdrawn)."""
        self.store.add(CHANGES, 1)

    def holder(self, slot: int) -> int | None:
        """The engine making slot `slot` now; None while nobody does (its holder was lost or
        handed it over)."""
        key = f"slot/{slot}/holder"
        if not self.store.check([key]):
            return slot  # never handed over: its own engine
        value = self.store.get(key).decode()
        return int(value) if value else None

    def take(self, slot: int, engine: int) -> bool:
        """Become the holder of a slot nobody holds; False if somebody does."""
        key = f"slot/{slot}/holder"
        return self.store.compare_set(key, "", str(engine)).decode() == str(engine)

    def release(self, slot: int, engine: int) -> None:
        self.store.compare_set(f"slot/{slot}/holder", str(engine), "")

    def mark_lost(self, engine: int) -> RosterState | None:
        """Record that `engine` is lost and give its slots to the live engines with the fewest
        slots (lowest index first). Returns the new state, or None when it was lost already
        (another rank's watchdog said so first). With no live engine left the state has an
        empty `live`: the caller fails the job."""
        with self._locked():
            state = self.read()
            if engine in state.lost:
                return None
            state.lost = sorted({*state.lost, engine})
            for s in state.slots_of(engine):
                live = state.live
                if live:
                    state.owner[s] = min(live, key=lambda e: (len(state.slots_of(e)), e))
            for s in range(self.engines):  # what the lost engine made is free to take
                if self.holder(s) == engine:
                    self.store.set(f"slot/{s}/holder", "")
            for key in (f"join/{engine}", f"join/{engine}/claimed"):  # it may be replaced
                self.store.delete_key(key)
            state.epoch += 1
            self.store.set(KEY, state.to_json())
            self.note_change()
            return state

    def rejoin(self, engine: int, ranks: list[int] = ()) -> RosterState | None:
        """A replacement for lost `engine` joined: it is live again and owns its own slot
        (the engine that adopted it hands it over at its next batch boundary). None, and
        nothing changed, when one of its `ranks` was found dead meanwhile (`done/<rank>` set
        again: lose_replacement)."""
        with self._locked():
            state = self.read()
            if engine not in state.lost:
                raise ValueError(f"engine {engine} is not lost: it cannot be replaced")
            if any(self.store.check([f"done/{r}"]) for r in ranks):
                return None
            state.lost = [e for e in state.lost if e != engine]
            state.owner[engine] = engine
            state.epoch += 1
            self.store.set(KEY, state.to_json())
            self.note_change()
            return state

    def lose_replacement(self, engine: int, ranks: list[int]) -> bool | None:
        """A rank of lost `engine` was found dead: if a replacement had claimed it (it deleted
        its ranks' `done/<rank>` marks), mark them lost again, under the lock that `rejoin`
        takes, so it either rejoins before (None: the engine is live, declare the loss anew)
        or never. Returns whether a replacement was lost (False: nothing to do)."""
        with self._locked():
            if engine not in self.read().lost:
                return None
            if not self.store.check([f"join/{engine}/claimed"]):
                return False
            if all(self.store.check([f"done/{r}"]) for r in ranks):
                return False  # (marked already)
            for r in ranks:
                self.store.set(f"done/{r}", "lost")
            return True

    def _locked(self, stale_s: float = LOCK_STALE_S):
        """The roster's store lock. Its holders change a few keys and let go within
        milliseconds; one killed while holding it (kill -9 of the rank whose watchdog was
        declaring a loss) would hold it forever, so a lock held `stale_s` is broken."""
        store = self.store

        class _Lock:
            def __enter__(self):
                since = time.monotonic()
                while store.add(LOCK, 1) != 1:  # a ticket: 1 means nobody else holds it
                    store.add(LOCK, -1)
                    if time.monotonic() - since > stale_s:
                        store.set(LOCK, "0")  # its holder is gone: break it
                        since = time.monotonic()
                    time.sleep(0.01)

            def __exit__(self, *exc):
                store.add(LOCK, -1)

        return _Lock()


def started_key(rank: int) -> str:
    """Set by generator rank `rank` of the launch once it has built every group it shares
    with the trainers at start-up (weights, resharding, its engine's rollout channels:
    generator/loop.py). An engine lost before all its ranks have stops the job
    (runtime/setup.py: engine_loss_excuse): the trainers wait in the making of those groups
    for every engine of the launch."""
    return f"started/{rank}"
