"""Following the trainer's weights on a generator: receive every announced broadcast in order,
load it, and run the held-out evaluation when the loaded version passes an eval point."""

from __future__ import annotations

import time
from collections.abc import Callable

from llamarl.generator.engine import Engine
from llamarl.generator.evaluate import Evaluator
from llamarl.parallel.weight_sync import announced_version
from llamarl.runtime.key_sequence import KeySequence
from llamarl.runtime.setup import Runtime
from llamarl.timeline import Timeline

_WAIT_S = 1.0  # longest blind wait for an announcement: the watchdog is checked in between


def fresh_version(b: int, k: int, every: int) -> int:
    """The newest version the trainer publishes before it takes batch b - 1: b - 1 rounded
    down to a multiple of `every` (sync.every), and never below the bound b - k."""
    return max(b - k, (b - 1) // every * every)


class WeightFollower:
    """Tracks and loads the trainer's weight broadcasts, in order, and runs evaluations when
    the loaded version passes an eval point."""

    def __init__(self, rt: Runtime, engine: Engine, evaluator: Evaluator, timeline: Timeline):
        self.rt, self.engine, self.evaluator = rt, engine, evaluator
        self.timeline = timeline
        self.received = 0  # broadcasts loaded
        self.version = 0
        self.final: int | None = None
        self._asked_after = -1  # self.received when the store was last asked for `final`
        every = rt.cfg.run.eval_every
        self.next_eval = every if every else None
        self.evaluated = {0}
        # trainer 0's announcements (`wsync/version/<i>`, parallel/weight_sync.py), followed
        # by a thread blocked in the store: started at the first follow()
        self._announcements: KeySequence | None = None

    def resumed_at(self, step: int) -> None:
        """The run continues after `step`, which was evaluated before the checkpoint."""
        self.evaluated = {step}
        every = self.rt.cfg.run.eval_every
        self.next_eval = (step // every + 1) * every if every else None

    def load_first(self) -> None:
        """Block until the next announced broadcast (the trainers' first: their weights at
        start, at resume, or at a replacement's first sync) and load it. The engine holds
        placeholder weights until then (vLLM's dummy load, generator/loop.py)."""
        if self._announcements is None:
            self._announcements = KeySequence(self.rt.new_store, "wsync/version",
                                              self.received, name="llamarl-announcements")
        while not self._announcements.seen(self.received, _WAIT_S):
            self.rt.watchdog.check()
        self._load()

    def trainer_done(self) -> bool:
        if self.final is None and self.rt.store.check(["trainer/final_version"]):
            self.final = int(self.rt.store.get("trainer/final_version"))
        return self.final is not None

    def _done_after_loads(self) -> bool:
        """trainer_done(), asked of the store once per broadcast loaded rather than once per
        call: trainer 0 sets trainer/final_version before it announces its last broadcast,
        so the answer can only change to yes by the time a new one is loaded. (follow() runs
        between every two engine steps of continuous mode; a store round trip each time was
        4% of the engine's time in a py-spy profile of bench/continuous_generation.py.)"""
        if self.final is None and self._asked_after != self.received:
            self._asked_after = self.received
            self.trainer_done()
        return self.final is not None

    def _load(self) -> None:
        """Receive and load broadcast number `self.received` (announced)."""
        start = time.time()
        self.engine.post_weights()  # the bytes start moving; the version is read meanwhile
        v = announced_version(self.rt.store, self.received)
        self.engine.load_posted_weights(v)
        self.timeline.record("load_weights", start, time.time(), v)
        self.received += 1
        self.version = v
        if self.next_eval is not None and v >= self.next_eval:
            self.evaluator.run(step=v, version=v)
            self.evaluated.add(v)
            while self.next_eval <= v:
                self.next_eval += self.rt.cfg.run.eval_every

    def follow(self, need: int, prefer: int | None = None,
               queued: Callable[[], bool] = lambda: False, exact: bool = False,
               interrupt: Callable[[], bool] = lambda: False) -> bool | None:
        """Load announced weights until version >= need, and on until version >= prefer
        while `queued()` (the trainer still has a batch of this engine to train on). False
        once the trainer is done and its final weights are loaded (no more batches needed).
        `exact` (sync.deterministic): stop at the first version >= need even when newer
        ones are announced, so the version a batch is sampled from depends on the step
        alone, never on timing. None, before `need` is reached, when `interrupt()` says the
        work changed (this engine took over a lost engine's slot, whose batch the trainer
        may need before it can publish `need`)."""
        if self._announcements is None:  # from the first sync this engine receives
            self._announcements = KeySequence(self.rt.new_store, "wsync/version",
                                              self.received, name="llamarl-announcements")
        announced = self._announcements.seen
        while True:
            while announced(self.received) and not (
                    exact and self.version >= need and not self.trainer_done()):
                self._load()  # every announced broadcast, in order (the senders wait for it)
            if self._done_after_loads() and self.version >= self.final:
                return False
            if self.version >= need and (prefer is None or self.version >= prefer
                                         or not queued()):
                return True
            if self.trainer_done() and self.version >= self.final:  # (about to wait: ask)
                return False
            self.rt.watchdog.check()
            # Woken by the store the moment trainer 0 announces the next broadcast: no
            # polling sleep between the announcement and posting the receives.
            if announced(self.received, _WAIT_S):
                self._load()
            elif interrupt():
                return None

    def finish(self) -> None:
        """Final weights loaded: evaluate them (the trainer's summary waits for this)."""
        if self.final not in self.evaluated:
            self.evaluator.run(step=self.final, version=self.final)
