"""The trainer's side of the rollout channels: one step's groups from the engines whose shares
meet this rank's (parallel/shares.py), with the samples too stale to train on set apart
(sync.max_staleness). Trainer 0 also reads the info of every other engine's batch (its metrics
and checkpointed data states) from the store."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from llamarl.buffer.channels import info_key, open_channel
from llamarl.buffer.record import RolloutBatch
from llamarl.parallel.plan import plan_for
from llamarl.runtime.setup import Runtime, log
from llamarl.timeline import Timeline


@dataclass
class Rollouts:
    """One step's rollouts on this trainer rank."""

    parts: list[RolloutBatch]  # one per engine of this rank, as it arrived (with its .info)
    batch: RolloutBatch | None  # what is trained on: the fresh samples (None: none left)
    dropped: RolloutBatch | None  # the stale ones (masked filler; counted)
    wait_s: float  # blocked on the channels (the engines had not put the batch yet)
    transfer_s: float  # the rest of the read: copying the batches out of the channels
    # trainer 0: the info of the batches of the engines it reads no part of (from the store)
    others: list[dict]

    @property
    def info(self) -> list[dict]:
        """Each engine's counts of its batch (generator/loop.py's sample_batch), engine order:
        this rank's engines' and, on trainer 0, every other's."""
        return sorted([p.info for p in self.parts] + self.others, key=lambda i: i["engine"])

    def data_states(self) -> dict[str, dict]:
        """Per engine, the prompt loader's state after this batch (saved in checkpoints)."""
        return {str(i["engine"]): i["data_state"] for i in self.info}


class RolloutReader:
    """Channels to this trainer rank from the engines that send it groups (buffer/channel.py,
    parallel/shares.py)."""

    def __init__(self, rt: Runtime, timeline: Timeline):
        plan = plan_for(rt)
        engines = plan.rollout_engines(rt.role.index)
        self.channels = [open_channel(rt, e, rt.role.index, "consumer") for e in engines]
        self.rt = rt
        # trainer 0 reports and checkpoints every engine: the info of those it reads no part of
        self.others = ([e for e in range(rt.layout.engines) if e not in engines]
                       if rt.role.index == 0 else [])
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
            t_others = time.perf_counter()
            others = self._other_infos(step)
            others_s = time.perf_counter() - t_others
        wait_s = sum(ch.wait_s for ch in self.channels) - sum(waits) + others_s
        transfer_s = time.perf_counter() - t_step - wait_s
        batch, dropped = drop_stale(RolloutBatch.concat(parts), version, self.max_staleness)
        return Rollouts(parts, batch, dropped, wait_s, transfer_s, others)

    def _other_infos(self, step: int) -> list[dict]:
        """Trainer 0: the info of batch `step` of every engine it reads no part of, written to
        the store by the batch's maker before any part of it left (generator/slots.py), so
        no later than the other trainer ranks can train on it. Waits like a channel read:
        until they are there, a dead peer ending the job through the watchdog."""
        if not self.others:
            return []
        keys = [info_key(e, step) for e in self.others]
        while True:
            self.rt.watchdog.check()
            try:
                self.rt.store.wait(keys, timedelta(seconds=30))
                break
            except dist.DistStoreError:
                continue  # generation is slower than that: look at the watchdog again
        infos = [json.loads(v) for v in self.rt.store.multi_get(keys)]
        for key in keys:
            self.rt.store.delete_key(key)
        return infos


def drop_stale(batch: RolloutBatch, version: int, max_staleness: int):
    """Keep samples at most `max_staleness` versions older than `version`. Returns the kept
    batch (or None if nothing is left) and the dropped one (or None)."""
    fresh = (version - batch.policy_version) <= max_staleness
    if bool(fresh.all()):
        return batch, None
    keep = fresh.nonzero().flatten()
    return (batch.select(keep) if len(keep) else None), batch.select((~fresh).nonzero().flatten())
