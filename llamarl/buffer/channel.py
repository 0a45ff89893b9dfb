"""The experience buffer's channel: one producer (a generator engine) -> one consumer (a
trainer rank), with the same contract whatever carries the bytes.

Control always goes through the job's TCPStore: a queue of small JSON descriptors and an
`acked` counter. The payload goes through shared memory when both ends are on one host
(`ShmChannel`), or over a point-to-point process group when they are not (`DistChannel`:
gloo on CPU, NCCL on GPU). `open_channel` picks the transport from where the two ranks sit in
the layout; the user sets nothing.

Backpressure: `put` blocks while `capacity` batches are unconsumed; nothing is ever dropped by
the buffer. Staleness is the trainer's business (it drops and counts stale samples).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from llamarl.buffer.record import RolloutBatch
from llamarl.runtime.key_sequence import KeySequence

POLL_S = 0.002
ADOPT_GRACE_S = 30.0  # adopt: time for a consumer to finish a batch it popped
# A consumer with a waker looks at its queue (and its peers' health) this often while it
# waits, and at once when the waker sees a push (see Channel.get).
WAKED_POLL_S = 0.05


class Channel:
    # whether put marks each push for the consumer's waker (a transport whose consumer waits
    # in Channel.get with one)
    wakes_consumer = False

    def __init__(self, store, channel: str, capacity: int,
                 check_alive: Callable[[], None] = lambda: None,
                 make_store: Callable[[], object] | None = None):
        self.store = store
        self.channel = channel
        self.capacity = capacity
        self.check_alive = check_alive  # raises if a peer is dead, so waits never hang
        self.queue_key = f"buf/{channel}/queue"
        self.acked_key = f"buf/{channel}/acked"
        self._seq = 0  # batches published
        self._unacked: list = []  # per unconsumed batch: what the transport must release
        self.wait_s = 0.0  # time spent blocked (backpressure or empty queue)
        self.last_put_s = 0.0  # cost of the last put, waiting excluded
        # consumer side: batches taken, and the waker of its waits (a store connection of its
        # own, started on the first get; None: poll every POLL_S)
        self._taken = 0
        self._make_store = make_store
        self._waker: KeySequence | None = None

    # -- producer -------------------------------------------------------------------------
    def put(self, batch: RolloutBatch, abort: Callable[[], bool] = lambda: False) -> bool:
        """Publish `batch`; blocks while `capacity` batches are unconsumed. Returns False,
        without publishing, if `abort()` turns true while blocked."""
        t0 = time.perf_counter()
        while self.unconsumed() >= self.capacity:
            self.check_alive()
            if abort():
                self.wait_s += time.perf_counter() - t0
                return False
            time.sleep(POLL_S)
        t1 = time.perf_counter()
        self.wait_s += t1 - t0
        self._forget_acked()
        handle, desc = self._send(batch, self._seq)
        self._unacked.append(handle)
        self.store.queue_push(self.queue_key, json.dumps(desc))
        if self.wakes_consumer:  # (its consumer's waker deletes the key)
            self.store.set(f"{self.queue_key}/pushed/{self._seq}", "")
        self._seq += 1
        self.last_put_s = time.perf_counter() - t1
        return True

    def unconsumed(self) -> int:
        """Producer side: batches published that the consumer has not taken yet."""
        return self._seq - self._acked()

    def _acked(self) -> int:
        return self.store.add(self.acked_key, 0)

    def _forget_acked(self) -> None:
        done = len(self._unacked) - (self._seq - self._acked())
        del self._unacked[:max(done, 0)]

    def adopt(self) -> int | None:
        """Producer side, taking over a channel whose producer was lost or let go
        (runtime/roster.py): continue its numbering. Shared memory outlives its writer, so
        every batch published stays to be consumed and the numbering continues after them.
        A transport whose payload dies with its producer asks the consumer (resumed(), see
        dist_channel.py). Returns how many batches the channel has carried, or None until
        that is known."""
        if not self.payload_outlives_producer:
            return self.resumed()
        # acked + queued is one short while a consumer has popped a batch and not acked it:
        # then a payload is at that number, and the number moves on at the ack. (Or one was
        # published and never pushed, the producer dying in between: released after the
        # grace.) Read until the number holds across a look at its payload.
        deadline = time.monotonic() + ADOPT_GRACE_S
        while True:
            acked = self._acked()
            self._seq = acked + self.store.queue_len(self.queue_key)
            if self._exists(self._handle(self._seq)) and time.monotonic() < deadline:
                self.check_alive()
                time.sleep(POLL_S)
            elif self._acked() + self.store.queue_len(self.queue_key) == self._seq:
                break
        self._unacked = [self._handle(seq) for seq in range(acked, self._seq)]
        self._release(self._handle(self._seq))  # a payload it was writing, never published
        return self._seq

    # -- consumer -------------------------------------------------------------------------
    def get(self) -> RolloutBatch:
        # With a waker (make_store given: the trainer's channels), a thread blocked in the
        # store on the producer's marks of its pushes wakes this wait the moment batch
        # `_taken` is pushed; the queue and the peers' health are still looked at every
        # WAKED_POLL_S, so a mark never set (a producer that died between its push and its
        # mark) costs latency, never a hang. Polling the store every POLL_S (2 ms) instead
        # cost about 4.5% of a core in the consumer alone and more in the store's server
        # (docs/measured.md), taken from the engines while they generate.
        t0 = time.perf_counter()
        if self._waker is None and self._make_store is not None:
            self._waker = KeySequence(self._make_store, f"{self.queue_key}/pushed",
                                      delete=True, name="llamarl-push-waker")
        while self.store.queue_len(self.queue_key) == 0:
            self.check_alive()
            if self._waker is not None:
                self._waker.seen(self._taken, WAKED_POLL_S)
            else:
                time.sleep(POLL_S)
        self.wait_s += time.perf_counter() - t0
        desc = json.loads(self.store.queue_pop(self.queue_key, False))
        self._taken += 1
        batch = self._receive(desc)
        self.store.add(self.acked_key, 1)
        self._consumed(desc)
        return batch

    # -- any exit path --------------------------------------------------------------------
    def close(self, drain_timeout_s: float = 0.0) -> int:
        """Producer exit. On a normal exit wait up to `drain_timeout_s` for the consumer to take
        what is in flight; then (and on failure paths, at once) release what was never
        consumed. Returns how many unconsumed batches were released."""
        deadline = time.monotonic() + drain_timeout_s
        try:
            while self._unacked and self._seq - self._acked() > 0:
                if time.monotonic() > deadline:
                    break
                self.check_alive()
                time.sleep(POLL_S)
            self._forget_acked()
        except Exception:  # the store or a peer is gone: nothing will consume them
            pass
        released = sum(1 for h in self._unacked if self._release(h))
        self._unacked.clear()
        return released

    # -- transport ------------------------------------------------------------------------
    def _send(self, batch: RolloutBatch, seq: int) -> tuple[object, dict]:
        """Make the payload available; return (handle to release if unconsumed, descriptor)."""
        raise NotImplementedError

    def _receive(self, desc: dict) -> RolloutBatch:
        raise NotImplementedError

    def _consumed(self, desc: dict) -> None:
        """Consumer side, after the ack: free what the transport still holds of the batch."""

    def _exists(self, handle) -> bool:
        """Whether the payload of `handle` is still there (transports whose payload outlives
        its producer: adopt)."""
        return False

    def _release(self, handle) -> bool:
        """Free an unconsumed payload; True if something was freed."""
        raise NotImplementedError

    payload_outlives_producer = False  # see adopt

    def resumed(self) -> int | None:
        """adopt() of a transport whose payload dies with its producer."""
        raise NotImplementedError

    def _handle(self, seq: int):
        """The release handle of batch `seq` (adopt), as _send returned it."""
        raise NotImplementedError
