"""Cross-host rollout transport: the payload travels over a two-rank process group (gloo on
CPU, NCCL on GPU) built on the job store; control is the store's, as for every channel.

The producer hands packed batches to a sender thread, so a generator never blocks in a send
while the trainer is busy: `put` returns as soon as the descriptor is queued. Sends and
receives happen in publication order on one pair, so the i-th descriptor matches the i-th
payload.
"""

from __future__ import annotations

import queue
import threading

import torch

from llamarl.buffer import pack
from llamarl.buffer.channel import Channel
from llamarl.buffer.record import RolloutBatch
from llamarl.parallel.groups import make_group

PRODUCER, CONSUMER = 0, 1


class DistChannel(Channel):
    def __init__(self, rt, channel: str, side: str, capacity: int):
        super().__init__(rt.store, channel, capacity, rt.watchdog.check)
        self.transport = rt.group_spec("x", 0, 2).backend + " (cross-host)"
        assert side in ("producer", "consumer"), side
        self.rank = PRODUCER if side == "producer" else CONSUMER
        self.device = rt.device
        # Both ends construct the pair group (a rendezvous on the store).
        self.group = make_group(rt.group_spec(f"xfer/{channel}", self.rank, 2))
        self._outbox: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _send(self, batch: RolloutBatch, seq: int) -> tuple[int, dict]:
        if self._error is not None:
            raise RuntimeError(f"rollout send on {self.channel} failed: {self._error}")
        layout, payload = pack.pack(batch)
        if self._thread is None:
            self._thread = threading.Thread(target=self._send_loop, daemon=True,
                                            name=f"llamarl-xfer-{self.channel}")
            self._thread.start()
        self._outbox.put(payload.to(self.device))
        return seq, {"size": payload.numel(), "layout": layout, "info": batch.info}

    def _send_loop(self) -> None:
        while True:
            payload = self._outbox.get()
            try:
                self.group.send([payload], CONSUMER, 0).wait()
            except BaseException as e:
                self._error = e
                return

    def _receive(self, desc: dict) -> RolloutBatch:
        buf = torch.empty(desc["size"], dtype=torch.uint8, device=self.device)
        self.group.recv([buf], PRODUCER, 0).wait()
        return pack.unpack(desc["layout"], buf.cpu(), desc["info"])

    def _release(self, seq: int) -> bool:
        return True  # an unconsumed payload is only memory in this process: gone at exit
