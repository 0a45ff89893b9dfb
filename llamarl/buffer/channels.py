"""The rollout channels of a job: channel e<e>t<r> carries engine e's groups for trainer rank r,
through shared memory when both ends share a node (buffer/shm.py), else over the pair group
the communication plan names for it (buffer/dist_channel.py, parallel/plan.py)."""

from __future__ import annotations

from llamarl.buffer.channel import Channel
from llamarl.buffer.dist_channel import DistChannel
from llamarl.buffer.shm import ShmChannel
from llamarl.parallel.plan import channel_name, plan_for


def open_channel(rt, engine: int, trainer: int, side: str,
                 takeover: str | None = None) -> Channel:
    """The channel engine -> trainer rank, from either side ("producer" | "consumer").
    `takeover`: a producer continuing the channel of a lost one (unique name; see adopt and
    dist_channel.py)."""
    name, plan = channel_name(engine, trainer), plan_for(rt)
    if plan.rollout_group(engine, trainer) is None:  # one node: shared memory
        return ShmChannel(rt.store, rt.run_id, name, rt.cfg.buffer.capacity, rt.watchdog.check,
                          make_store=rt.new_store if side == "consumer" else None)
    # the consumer follows takeovers when engines can be lost (dist_channel.py)
    follow = side == "consumer" and plan.survives_engine_loss
    return DistChannel(rt, name, side, rt.cfg.buffer.capacity, follow=follow,
                       takeover=takeover)


def info_key(slot: int, batch: int) -> str:
    """The store key of the info (RolloutBatch.info) of slot `slot`'s batch `batch` when
    trainer 0 gets no part of it (parallel/shares.py): the slot's maker writes it before any
    part leaves, trainer 0 reads it for its metrics and checkpoints and deletes it."""
    return f"rollout/info/{slot}/{batch}"
