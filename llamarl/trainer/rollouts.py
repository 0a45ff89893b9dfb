"""The trainer's side of the rollout channels: one step's batch from every engine, with the
samples too stale to train on set apart (sync.max_staleness)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from llamarl.buffer.channels import open_channel
from llamarl.buffer.record import RolloutBatch
from llamarl.runtime.setup import Runtime, log
from llamarl.timeline import Timeline


@dataclass
class Rollouts:
    """One step's rollouts on this trainer rank."""

    parts: list[RolloutBatch]  # one per engine, as it arrived (each with its .info)
    batch: RolloutBatch | None  # what is trained on: the fresh samples (None: none left)
    dropped: RolloutBatch | None  # the stale ones (masked filler; counted)
    wait_s: float  # blocked on the channels (the engines had not put the batch yet)
    transfer_s: float  # the rest of the read: copying the batches out of the channels

    @property
    def info(self) -> list[dict]:
        """Each engine's counts of its batch (generator/loop.py's sample_batch)."""
        return [p.info for p in self.parts]

    def data_states(self) -> dict[str, dict]:
        """Per engine, the prompt loader's state after this batch (saved in checkpoints)."""
        return {str(i["engine"]): i["data_state"] for i in self.info}


class RolloutReader:
    """Channels from every engine to this trainer rank (buffer/channel.py)."""

    def __init__(self, rt: Runtime, timeline: Timeline):
        self.channels = [open_channel(rt, e, rt.role.index, "consumer")
                         for e in range(rt.layout.engines)]
        self.max_staleness = rt.cfg.sync.max_staleness
        self.timeline = timeline
        log(rt, "rollout channels: " + ", ".join(f"{ch.channel} over {ch.transport}"
                                                 for ch in self.channels))

    def next(self, step: int, version: int) -> Rollouts:
        """Step `step`'s batch of every engine, trained by policy `version`."""
        t_step = time.perf_counter()
        waits = [ch.wait_s for ch in self.channels]
        with self.timeline.phase("wait_rollouts", step):
            parts = [ch.get() for ch in self.channels]
        wait_s = sum(ch.wait_s for ch in self.channels) - sum(waits)
        transfer_s = time.perf_counter() - t_step - wait_s
        batch, dropped = drop_stale(RolloutBatch.concat(parts), version, self.max_staleness)
        return Rollouts(parts, batch, dropped, wait_s, transfer_s)


def drop_stale(batch: RolloutBatch, version: int, max_staleness: int):
    """Keep samples at most `max_staleness` versions older than `version`. Returns the kept
    batch (or None if nothing is left) and the dropped one (or None)."""
    fresh = (version - batch.policy_version) <= max_staleness
    if bool(fresh.all()):
        return batch, None
    keep = fresh.nonzero().flatten()
    return (batch.select(keep) if len(keep) else None), batch.select((~fresh).nonzero().flatten())
