"""Cross-host rollout transport: the payload travels over a two-rank gloo process group built on
the job store, from host memory to host memory, on GPU jobs too; control is the store's, as for
every channel.

Why gloo on GPUs: a rollout batch is small (about 0.6 MB a channel a step for a 7B GRPO step,
docs/scaling.md) and is packed and unpacked in host memory anyway, while an NCCL pair would be
one more communicator on the engine's GPU (memory, start-up) whose sends, posted from this
channel's thread, would be in flight beside the weight sync's receives: two communicators'
kernels on one GPU in no agreed order, which can deadlock (bench/nccl_order_check.py finds it at
one trainer and one engine). Over gloo no rollout byte touches a GPU stream.

The producer hands packed batches to a sender thread, so a generator never blocks in a send
while the trainer is busy: `put` returns as soon as the descriptor is queued. Sends and
receives happen in publication order on one pair, so the i-th descriptor matches the i-th
payload.

Taking the channel over (runtime/roster.py: its producer engine was lost, or hands its slot
back to a replacement). A payload lives only in its producer's process, so what a lost producer
had queued but the trainer had not received is made again; the trainer decides what that is:
  * the new producer names a new pair group in `buf/<channel>/takeover` and waits;
  * the consumer, polling while it waits for a batch, sees it: it drops every queued
    descriptor of the old pair (and gives up a receive in flight from it), then writes how
    many batches it has taken, `buf/<channel>/resume/<pair>`;
  * the new producer continues from that number, on its pair (both ends build the group when
    its first batch comes). A descriptor of any other pair is dropped from then on.
"""

from __future__ import annotations

import json
import queue
import threading
import time

import torch

from llamarl.buffer import pack
from llamarl.buffer.channel import POLL_S, Channel
from llamarl.buffer.record import RolloutBatch
from llamarl.parallel.groups import job_group_spec, make_group

PRODUCER, CONSUMER = 0, 1
TAKEOVER_POLL_S = 0.05  # how often a waiting consumer looks for a takeover


class DistChannel(Channel):
    def __init__(self, rt, channel: str, side: str, capacity: int, follow: bool = False,
                 takeover: str | None = None):
        super().__init__(rt.store, channel, capacity, rt.watchdog.check)
        self.rt = rt
        self.transport = "gloo (cross-host)"
        assert side in ("producer", "consumer"), side
        self.rank = PRODUCER if side == "producer" else CONSUMER
        self.device = torch.device("cpu")  # host memory at both ends (module doc)
        # consumer: give up on a lost producer when a takeover is announced (see module doc)
        self.follow = follow
        self.takeover_key = f"buf/{channel}/takeover"
        self._abandoned: list = []  # groups of lost producers: never destroyed mid-receive
        self._outbox: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._resume_key: str | None = None  # producer: a takeover waiting for its number
        if takeover is not None:  # a new producer (see begin_takeover)
            self.begin_takeover(takeover)
            return
        # Both ends construct the launch's pair group (a rendezvous on the store).
        self.pair = f"xfer/{channel}"
        self.group = make_group(job_group_spec(rt, self.pair, self.rank, 2, "gloo"))

    # -- producer -------------------------------------------------------------------------
    def begin_takeover(self, name: str) -> None:
        """Announce that this process continues the channel on pair group `name` (unique per
        takeover); `resumed` says from which batch once the consumer has answered."""
        self.pair, self.group = f"xfer/{self.channel}/{name}", None
        self._resume_key = f"buf/{self.channel}/resume/{self.pair}"
        self.store.set(self.takeover_key, self.pair)

    def resumed(self) -> int | None:
        """After begin_takeover: the number of batches the channel has carried, once the
        consumer has said (None before); the next put continues from there."""
        if self._resume_key is not None:
            if not self.store.check([self._resume_key]):
                return None
            self._seq, self._unacked = int(self.store.get(self._resume_key)), []
            self._resume_key = None
        return self._seq

    def _send(self, batch: RolloutBatch, seq: int) -> tuple[int, dict]:
        if self._error is not None:
            raise RuntimeError(f"rollout send on {self.channel} failed: {self._error}")
        layout, payload = pack.pack(batch)
        if self._thread is None:
            self._thread = threading.Thread(target=self._send_loop, daemon=True,
                                            name=f"llamarl-xfer-{self.channel}")
            self._thread.start()
        self._outbox.put(payload)
        return seq, {"size": payload.numel(), "layout": layout, "info": batch.info,
                     "pair": self.pair}

    def _send_loop(self) -> None:
        try:
            if self.group is None:  # a takeover's pair: the consumer builds it at our batch
                self.group = make_group(job_group_spec(self.rt, self.pair, PRODUCER, 2,
                                                       "gloo"))
            while True:
                payload = self._outbox.get()  # (host memory: pack.pack makes it there)
                self.group.send([payload], CONSUMER, 0).wait()
                del payload
        except BaseException as e:
            self._error = e

    def _release(self, seq: int) -> bool:
        return True  # an unconsumed payload is only memory in this process: gone at exit

    # -- consumer -------------------------------------------------------------------------
    def get(self) -> RolloutBatch:
        t0, last_look = time.perf_counter(), 0.0
        while True:
            if self.store.queue_len(self.queue_key) > 0:
                desc = json.loads(self.store.queue_pop(self.queue_key, False))
                self.wait_s += time.perf_counter() - t0
                batch = self._receive(desc)
                t0 = time.perf_counter()
                if batch is not None:
                    self.store.add(self.acked_key, 1)
                    return batch
                continue  # a lost producer's: made again by the next one
            self.check_alive()
            if self.follow and time.monotonic() - last_look > TAKEOVER_POLL_S:
                last_look = time.monotonic()
                self._answer_takeover()
            time.sleep(POLL_S)

    def _taken_over(self) -> str | None:
        """The pair of a takeover announced and not answered yet, or None."""
        if not self.store.check([self.takeover_key]):
            return None
        pair = self.store.get(self.takeover_key).decode()
        return pair if pair != self.pair else None

    def _answer_takeover(self) -> bool:
        """If a new producer took the channel over: drop the old pair's queued descriptors
        and tell it how many batches were taken. True if it did."""
        pair = self._taken_over()
        if pair is None:
            return False
        while self.store.queue_len(self.queue_key) > 0:
            self.store.queue_pop(self.queue_key, False)  # the old producer's: made again
        self._abandoned.append(self.group)
        self.pair, self.group = pair, None
        self.store.set(f"buf/{self.channel}/resume/{pair}", str(self.store.add(self.acked_key, 0)))
        return True

    def _receive(self, desc: dict) -> RolloutBatch | None:
        """The batch of `desc`, or None if it is a lost producer's (dropped)."""
        if desc.get("pair", self.pair) != self.pair:
            return None  # from before a takeover (its producer is gone)
        if self.group is None:  # the first batch of a takeover: build its pair, unless its
            # producer is lost before (another takeover is announced): then it is dropped
            self.group = make_group(job_group_spec(self.rt, self.pair, CONSUMER, 2, "gloo"),
                                    give_up=lambda: self._taken_over() is not None)
            if self.group is None:
                return None
        buf = torch.empty(desc["size"], dtype=torch.uint8, device=self.device)
        if not self.follow:
            self.group.recv([buf], PRODUCER, 0).wait()
            return pack.unpack(desc["layout"], buf.cpu(), desc["info"])
        # The producer may be lost with the payload half sent: wait in a thread (a gloo wait
        # that times out closes the pair) and give up when a takeover is announced. A producer
        # that died before the receive was posted fails the posting itself (gloo raises at
        # once on a connection its peer closed): the same loss, settled the same way.
        done, failed = threading.Event(), []

        def wait(work) -> None:
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - a lost producer, or re-raised
                failed.append(e)
            done.set()

        try:
            work = self.group.recv([buf], PRODUCER, 0)
        except RuntimeError as e:
            failed.append(e)
            done.set()
        else:
            threading.Thread(target=wait, args=(work,), daemon=True,
                             name=f"llamarl-recv-{self.channel}").start()
        deadline = None
        while not done.wait(TAKEOVER_POLL_S):
            self.check_alive()
            if self._answer_takeover():
                return None
        while failed:  # its producer died: a takeover follows, unless it was something else
            deadline = deadline or time.monotonic() + self.rt.cfg.sync.dead_peer_s + 10.0
            self.check_alive()
            if self._answer_takeover():
                return None
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout receive on {self.channel} failed: {failed[0]}")
            time.sleep(TAKEOVER_POLL_S)
        return pack.unpack(desc["layout"], buf.cpu(), desc["info"])
