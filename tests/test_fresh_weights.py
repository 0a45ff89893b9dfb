"""sync.prefer_fresh: while an engine's previous batch still waits in the buffer, the engine
waits for the trainer's next weights instead of sampling from weights max_staleness versions
old; once the buffer is empty it samples at once (max_staleness is then the only bound).

The follower runs against a real TCPStore, with the trainer's announcements made by a thread;
the broadcast itself (the engine's receive) is tested in test_weight_sync."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from llamarl.config import load_config
from llamarl.generator.weights import WeightFollower, fresh_version
from llamarl.timeline import Timeline


def test_fresh_version_is_the_last_version_published_before_the_previous_batch():
    assert fresh_version(b=5, k=2, every=1) == 4
    assert fresh_version(b=5, k=3, every=2) == 4  # versions go out after steps 2, 4, ...
    assert fresh_version(b=4, k=3, every=2) == 2
    assert fresh_version(b=4, k=2, every=4) == 2  # never below the bound b - k


class Trainer:
    """The trainer's side of the store protocol: announce broadcast i as version v."""

    def __init__(self, store):
        self.store, self.sent = store, 0

    def announce(self, version: int, after_s: float = 0.0) -> threading.Thread:
        def go():
            time.sleep(after_s)
            self.store.set(f"wsync/version/{self.sent}", str(version))
            self.sent += 1
        t = threading.Thread(target=go)
        t.start()
        return t


@pytest.fixture
def follower(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30),
                          wait_for_workers=False)
    rt = SimpleNamespace(store=store, cfg=load_config(None, ["run.eval_every=0"]),
                         watchdog=SimpleNamespace(check=lambda: None),
                         new_store=lambda: dist.TCPStore("127.0.0.1", store.port, None, False,
                                                         timeout=timedelta(seconds=30)))
    loads = []
    # the follower posts the receives, reads the announced version, then loads
    engine = SimpleNamespace(post_weights=lambda: None,
                             load_posted_weights=lambda v: loads.append(time.monotonic()))
    w = WeightFollower(rt, engine, evaluator=None, timeline=Timeline(tmp_path, 0, "generator 0"))
    w.loads = loads
    return w, Trainer(store)


def test_waits_for_the_next_version_while_a_batch_is_queued(follower):
    w, trainer = follower
    t0 = time.monotonic()
    trainer.announce(1, after_s=0.3)
    assert w.follow(need=0, prefer=1, queued=lambda: True)
    assert w.version == 1 and len(w.loads) == 1 and w.loads[0] - t0 >= 0.25


def test_samples_at_once_when_nothing_is_queued_or_nothing_preferred(follower):
    w, _ = follower
    t0 = time.monotonic()
    assert w.follow(need=0, prefer=1, queued=lambda: False)
    assert w.follow(need=0)
    assert w.version == 0 and not w.loads and time.monotonic() - t0 < 0.2


def test_stops_waiting_when_the_trainer_takes_the_queued_batch(follower):
    w, _ = follower
    drained = time.monotonic() + 0.3
    assert w.follow(need=0, prefer=1, queued=lambda: time.monotonic() < drained)
    waited = time.monotonic() - drained
    assert w.version == 0 and 0 <= waited < 1.5  # checked at least every wait of 1 s


def test_the_bound_still_holds_and_the_final_version_ends_the_wait(follower):
    w, trainer = follower
    trainer.announce(1).join()
    trainer.announce(2, after_s=0.2)
    assert w.follow(need=2, prefer=None)  # need is a hard bound: queued or not
    assert w.version == 2
    w.rt.store.set("trainer/final_version", "3")
    trainer.announce(3, after_s=0.2)
    assert not w.follow(need=2, prefer=3, queued=lambda: True)  # done: no more batches
    assert w.version == 3 and len(w.loads) == 3


def test_the_final_version_is_asked_of_the_store_once_per_load_not_once_per_call(follower):
    """Continuous mode calls follow() between every two engine steps: with nothing new to
    load it must not cost a store round trip (trainer 0 sets trainer/final_version before it
    announces its last broadcast, so the answer can only change once one is loaded)."""
    w, trainer = follower
    asked = []
    check = w.rt.store.check
    w.rt.store = SimpleNamespace(check=lambda keys: asked.append(keys) or check(keys),
                                 get=w.rt.store.get, set=w.rt.store.set)
    for _ in range(50):
        assert w.follow(need=0)
    assert len(asked) == 1
    w.rt.store.set("trainer/final_version", "1")
    trainer.announce(1).join()
    assert not w.follow(need=1)  # loaded, asked again: the final version is in
    assert w.version == 1 and len(asked) == 2
