"""The slots a generator makes (runtime/roster.py): for each, its prompt loader, its held-out
prompts, its channels to the trainer ranks and the next batch it owes.

An engine starts with its own slot. When another engine is lost and the roster gives this one
its slot, it takes the slot over at a batch boundary, at the first batch the lost engine did not
deliver to every trainer rank: its channels continue their numbering (the batches the lost
engine published stay in shared memory and are trained on, none is made twice), its prompt
loader continues from the state the lost engine wrote before that batch (`slot/<s>/after/<b>`),
and its sampling seeds are the slot's. The trainers read the same channels and see the same
batch size. A batch the lost engine delivered to some trainer ranks only is made again and sent
to the others, whole groups each, so no prompt group is trained twice.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field

from llamarl.buffer.channel import Channel
from llamarl.buffer.channels import info_key, open_channel
from llamarl.buffer.record import RolloutBatch, split_counts
from llamarl.data.dataset import PromptData
from llamarl.data.loader import PromptLoader, shard
from llamarl.data.prompts import PromptFormatter
from llamarl.parallel.plan import plan_for
from llamarl.runtime.roster import Roster
from llamarl.runtime.setup import Runtime, log
from llamarl.runtime.watchdog import peek


@dataclass
class Slot:
    index: int
    loader: PromptLoader
    held_out: list  # this slot's held-out prompts, encoded
    channels: dict[int, Channel]  # to each trainer rank the slot sends groups (shares.py)
    counts: list[int]  # groups of each batch per channel, in the channels' order
    next_batch: int | None  # None while a takeover waits for its trainer ranks' word
    skip: set[int] = field(default_factory=set)  # trainer ranks that have next_batch already


class SlotSet:
    """The slots this engine makes now. With `keep_states` (the job survives engine losses)
    each batch's prompt-loader state goes to the store first, for whoever takes the slot over."""

    def __init__(self, rt: Runtime, data: PromptData, fmt: PromptFormatter, first_batch: int,
                 keep_states: bool, own: bool = True, check=lambda prompts: None):
        self.rt, self.data, self.fmt, self.check = rt, data, fmt, check
        self.first_batch = first_batch  # the run's first batch in this launch (a resume's step)
        self.keep_states = keep_states
        self.me = rt.role.index
        self.shares = plan_for(rt).shares  # which trainer ranks get which of a slot's groups
        self.roster = Roster(rt.store, rt.layout.engines)
        self.epoch = 0
        self.slots: dict[int, Slot] = {}
        self.leaving: set[int] = set()  # slots the roster gives another engine, not let go yet
        if not own:  # a replacement: its slot comes back through refresh()
            self.epoch = -1
            return
        own = self._slot(self.me, first_batch)
        state = rt.resume.get("data_state", {}).get(str(self.me)) if first_batch else None
        if state is not None:
            own.loader.load_state_dict(state)
        elif first_batch:  # a checkpoint from before data states: every batch drew per_slot
            own.loader.next(first_batch * self.per_slot(self.me))
        self.slots = {self.me: own}

    def per_slot(self, s: int) -> int:
        """Prompt groups slot s makes a step (shares.py: the slots' shares differ by at most
        one)."""
        return self.shares.groups_of_engine(s)

    def _slot(self, s: int, next_batch: int | None, takeover: str | None = None) -> Slot:
        cfg, engines = self.rt.cfg, self.rt.layout.engines
        train = self.fmt.encode(shard(self.data.train, s, engines))
        held_out = self.fmt.encode(self.data.held_out[s::engines])
        self.check(train + held_out)
        routes = self.shares.routes_of_engine(s)
        channels = {route.trainer: open_channel(self.rt, s, route.trainer, "producer", takeover)
                    for route in routes}
        self.rt.watchdog.cleanups.extend(ch.close for ch in channels.values())
        return Slot(s, PromptLoader(train, cfg.run.seed, s, engines), held_out, channels,
                    [route.count for route in routes], next_batch)

    # -- at batch boundaries -------------------------------------------------------------
    def refresh(self) -> None:
        """Take over the slots the roster gives this engine (once their last holder has let
        go) and hand back those it no longer gives it (a replacement engine joined)."""
        if not self.keep_states:
            return
        for slot in self.slots.values():
            if slot.next_batch is None:  # a takeover: has every trainer rank answered?
                self._resolve(slot)
        state = self.roster.read()
        mine = set(state.slots_of(self.me))
        if state.epoch == self.epoch and mine == set(self.slots):
            return
        self.epoch = state.epoch
        self.leaving = {s for s in self.slots if s not in mine}
        kept = [sl.next_batch for s, sl in self.slots.items()
                if s in mine and sl.next_batch is not None]
        for s in sorted(self.leaving):
            if kept and (self.slots[s].next_batch or 0) > min(kept):
                # The trainers read the slots in step: a batch of this slot ahead of the slots
                # kept may not be consumed before they make theirs, and across hosts (below)
                # that would wait forever. It makes nothing more meanwhile (next(); the
                # continuous loop skips it) and goes once they have caught up.
                continue
            self.leaving.discard(s)
            slot = self.slots.pop(s)
            for ch in slot.channels.values():
                # Shared memory: its published batches stay until consumed, and the next
                # holder releases what is left at the end (Channel.adopt). A payload that
                # lives in this process is received before the slot is let go.
                while not ch.payload_outlives_producer and ch.unconsumed() > 0:
                    self.rt.watchdog.check()
                    time.sleep(0.01)
            self.roster.release(s, self.me)
            log(self.rt, f"handed slot {s} back at batch {slot.next_batch}")
        for s in sorted(mine - set(self.slots)):
            if self.roster.take(s, self.me):
                self.slots[s] = self._slot(s, None, takeover=f"{self.me}.{secrets.token_hex(3)}")
                self._resolve(self.slots[s])

    def changed(self) -> bool:
        """Whether `refresh` has something to do (read while waiting for weights)."""
        if not self.keep_states:
            return False
        state = self.roster.read()
        if (state.epoch != self.epoch
                or set(state.slots_of(self.me)) | self.leaving != set(self.slots)):
            return True
        return any(sl.next_batch is None
                   and all(ch.adopt() is not None for ch in sl.channels.values())
                   for sl in self.slots.values())

    def _resolve(self, slot: Slot) -> None:
        """A slot taken over: its next batch, once every channel knows where it stands."""
        carried = {t: ch.adopt() for t, ch in slot.channels.items()}  # batches each has
        if any(c is None for c in carried.values()):
            return  # a trainer rank has not answered yet (dist_channel.py)
        s, n = slot.index, min(carried.values())
        slot.next_batch = self.first_batch + n
        slot.skip = {t for t, c in carried.items() if c > n}
        if slot.next_batch > self.first_batch:
            key = f"slot/{s}/after/{slot.next_batch - 1}"
            slot.loader.load_state_dict(json.loads(self.rt.wait_key(key, timeout_s=60.0)))
        else:
            state = self.rt.resume.get("data_state", {}).get(str(s))
            if state is not None:
                slot.loader.load_state_dict(state)
        log(self.rt, f"took over slot {s} at batch {slot.next_batch}"
                     + (f" (trainer ranks {sorted(slot.skip)} have it already)"
                        if slot.skip else ""))

    def ready(self) -> bool:
        """Whether some slot's next batch is known (a takeover may still wait)."""
        return any(sl.next_batch is not None and s not in self.leaving
                   for s, sl in self.slots.items())

    def next(self) -> Slot:
        """The slot whose next batch is needed first."""
        return min((sl for s, sl in self.slots.items()
                    if sl.next_batch is not None and s not in self.leaving),
                   key=lambda sl: (sl.next_batch, sl.index))

    def queued(self) -> bool:
        """A batch of this engine still waits for the trainer."""
        return any(ch.unconsumed() > 0 for sl in self.slots.values()
                   for ch in sl.channels.values())

    def put(self, slot: Slot, batch: RolloutBatch, abort) -> None:
        """Ship `batch` (slot.next_batch) to the trainer ranks, whole groups each: the
        slot's contiguous runs of groups, in order (shares.py)."""
        b = slot.next_batch
        if self.keep_states:
            store = self.rt.store
            me = f"done/{self.rt.role.rank}"
            if peek(store, me) == b"lost":
                # declared lost while it stalled (silent for sync.dead_peer_s, or its engine's
                # other rank gone): its slots are another engine's now; publish nothing
                self.rt.watchdog.leave("this engine was declared lost while it stalled and "
                                       "its slots went to the others")
            store.set(f"slot/{slot.index}/after/{b}", json.dumps(slot.loader.state_dict()))
            if b - 2 >= self.first_batch:
                store.delete_key(f"slot/{slot.index}/after/{b - 2}")
        # what trainer 0 reports and checkpoints of every slot's batch: carried by the
        # batch when trainer 0 gets a part of it, else through the store (trainer/rollouts.py
        # reads it), written before any part leaves so it is there once a part is trained
        batch.info.update(behaviour_version=int(batch.policy_version.min()),
                          generator=int(batch.generator[0]))
        if 0 not in slot.channels:
            self.rt.store.set(info_key(slot.index, b), json.dumps(batch.info))
        for (t, channel), part in zip(slot.channels.items(), split_counts(batch, slot.counts)):
            if t not in slot.skip:
                channel.put(part, abort=abort)
        slot.skip = set()
        slot.next_batch += 1

    def held_out(self) -> dict[int, list]:
        return {s: sl.held_out for s, sl in sorted(self.slots.items())}

    def last_put_s(self) -> float:
        return sum(ch.last_put_s for sl in self.slots.values() for ch in sl.channels.values())

    def close(self) -> int:
        """Release unconsumed batches; returns how many."""
        return sum(ch.close() for sl in self.slots.values() for ch in sl.channels.values())
