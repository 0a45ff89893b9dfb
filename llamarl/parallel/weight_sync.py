"""Trainer -> generator weight sync: every trainer rank sends its own FSDP2 shard. One factory,
`open_weight_sync`, opens either end, as buffer.open_channel does for rollouts.

    weight_plan.py     what each trainer rank sends, and its buckets (one message each)
    weight_sender.py   packing a rank's shards into the buckets and sending them
    weight_gather.py   sync.senders one: the trainer ranks gather each bucket, trainer 0
                       alone sends full tensors (one weight group per engine GPU)
    weight_receiver.py receiving them and writing them into the engine (load_weights, then
                       replayed copies)
    transports/        what moves the bytes: `torch` (gloo / NCCL groups, the default) or
                       `filesystem`, chosen by sync.transport; a new one is one new file

FSDP2 shards each parameter along dim 0 over the T trainer ranks. Instead of all-gathering the
full model among the trainers and sending it again from one rank, trainer rank r sends its
local shards (torch transport: on its own group `wsync<r>` = [trainer r, every generator
rank]), and each generator puts the rows back together. Every byte crosses the wire once, and
the T trainer links work in parallel.

Per sync i, on trainer r (all T in lockstep with the same version):
    trainer 0: store `wsync/version/<i>` = policy version        (one key: the announcement)
    flat_b[off_j : off_j + n_j] = local shard of tensor j        (bucket b: one dtype,
    post flat_b to every generator, tag b                           <= bucket_mb; in order)
    (a shard of >= sync.solo_mb is its own bucket, sent from the parameter itself; a shard
    already in the wire dtype lives in flat_b for good, see fsdp.place_shards: no copy)
and on each generator worker, woken by the announcement:
    post the receives of all buckets of all T senders into the receive buffers
    (on gloo, when all go into receive buffers: already posted by the last load)
    as each bucket arrives: write its rows into the engine's parameters
(see WeightReceiver: the first sync goes through vLLM's load_weights and is recorded, later
ones replay the recorded copies straight from the receive buffers, and receive a bucket that
holds one piece straight into the engine parameter).

Each sender publishes its shard layout once (`wsync/meta/<r>`: name, dtype, full shape, rows,
first row); replicated tensors (or a model without FSDP2) are sent by trainer 0 alone. The
announcement comes before the broadcast, so a generator waiting between two generation
batches posts its receives while the trainers pack, and receives every broadcast in order.
Send and receive buffers are allocated once: one sync is in flight at a time. On the torch
transport the messages are NCCL broadcasts on GPU, and gloo's point-to-point sends and
receives on CPU, every message of a sync posted at once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from llamarl.config import adapter_sync, reshards
from llamarl.parallel.groups import GroupSpec, job_group_spec, planned_spec
from llamarl.parallel.plan import join_group_name, plan_for
from llamarl.parallel.transports import transport_module
from llamarl.parallel.transports.base import TransportSpec
from llamarl.parallel.weight_gather import OneSender
from llamarl.parallel.weight_plan import TensorMeta, metas_to_json
from llamarl.parallel.weight_receiver import WeightReceiver
from llamarl.parallel.weight_sender import WeightSender


def open_weight_sync(side: str, spec: TransportSpec, bucket_mb: int, device: torch.device,
                     solo_mb: float | None = None, *, model: torch.nn.Module | None = None,
                     store=None, wire_dtype: torch.dtype | None = None,
                     lost_grace_s: float = 0.0,
                     publish_metas: Callable[[list[TensorMeta]], None] | None = None,
                     metas: list[list[TensorMeta]] | None = None,
                     adapters: bool = False, members: Callable | None = None,
                     receive_buffers: int = 0,
                     gather_world: int = 0) -> WeightSender | WeightReceiver:
    """Open one end of a weight sync over transport `spec.name` (sync.transport), complete.

    side "send" (trainer rank spec.me): a WeightSender of `model`'s shards. Its shard layout
    goes to `publish_metas` before the transport connects (the receivers need every layout
    to build their end, and a torch group is built by all its members at once). `members`
    (transport -> Members), when engines can be lost: who receives each sync
    (parallel/weight_members.py).
    side "receive" (an engine): a WeightReceiver of the senders' layouts `metas`, with a pool
    of `receive_buffers` buffers where it can (sync.receive_buffers, WeightReceiver).
    `adapters` (model.lora.sync adapters): a LoRA policy's adapters alone are sent, and
    received for an adapter of vLLM's (generator/lora_adapter.py), not the engine's weights
    (no recorded replay, no resharding). `gather_world` (sync.senders one): the sender is a
    OneSender of that many trainer ranks (parallel/weight_gather.py), which gathers each
    bucket over the default process group; trainer 0 alone connects and publishes."""
    transport = transport_module(spec.name)
    if side == "send":
        assert model is not None

        def connect(layout: list[TensorMeta]):
            if publish_metas is not None:
                publish_metas(layout)
            if members is None:
                return transport.Sender(spec)
            return transport.Sender(spec, members=members)

        if gather_world:
            return OneSender(model, spec.me, gather_world, bucket_mb, device, store,
                             wire_dtype=wire_dtype, solo_mb=solo_mb, lost_grace_s=lost_grace_s,
                             adapters=adapters, connect=connect)
        return WeightSender(model, spec.me, bucket_mb, None, device, store,
                            wire_dtype=wire_dtype, solo_mb=solo_mb, lost_grace_s=lost_grace_s,
                            adapters=adapters, connect=connect)
    assert side == "receive" and metas is not None, side
    return WeightReceiver(metas, bucket_mb, transport.Receiver(spec), device, solo_mb,
                          replay=not adapters, receive_buffers=receive_buffers)


def transport_spec(rt, me: int, groups: list[GroupSpec],
                   options: dict | None = None) -> TransportSpec:
    """One end of the weight sync (parallel/transports) of the running job (a runtime.setup.
    Runtime): trainer rank `me` with its groups, or receiver `me` (1 + its index among the
    generator ranks) with one group per trainer rank (the plan's, parallel/plan.py, or a
    replacement's); the receivers expect `plan.senders` senders (sync.senders).
    `options`: the transport's own (TransportSpec.options)."""
    sync, layout, plan = rt.cfg.sync, rt.layout, plan_for(rt)
    # filesystem: a directory of this launch's own (run_id is new at every launch, a
    # restart's included), so no run reads the files of another sharing transport_dir
    directory = Path(sync.transport_dir or rt.run_dir / "weight_sync") / rt.run_id
    if plan.weight_pairs:  # point to point on each pair group (torch_dist.Sender)
        options = {**(options or {}), "pairs": True}
    # resharded syncs broadcast to one tp rank's receivers: [trainer r, tp rank k of every
    # engine] (gloo sends point to point and needs none)
    tp_groups = [planned_spec(rt, g) for g in plan.reshard_groups_of(rt.role.rank)]
    return TransportSpec(sync.transport, me, plan.senders,
                         len(layout.generator_global_ranks),
                         tuple(groups), str(directory),
                         sync.timeout_s, layout.tp, reshards(rt.cfg), tuple(tp_groups),
                         (rt.env.master_addr, rt.env.master_port, rt.prefix), options or {})


def open_sender(rt, model: torch.nn.Module) -> WeightSender:
    """Trainer rank r's end of the weight sync, complete: on the plan's groups (torch
    transport: wsync<r> = [trainer r, every generator rank], or one pair group per engine),
    its shard layout published in the store for the engines (`wsync/meta/<r>`, read by
    `engine_transport`'s callers), and, when the job survives engine losses, the members
    that follow the roster (parallel/weight_members.py). One sender (sync.senders): every
    trainer rank gathers, trainer 0 alone has groups and publishes `wsync/meta/0` (the full
    tensors)."""
    from llamarl.parallel.weight_members import EngineMembers, FileMembers

    r, sync, plan = rt.role.index, rt.cfg.sync, plan_for(rt)
    spec = transport_spec(rt, r, [planned_spec(rt, g) for g in plan.weight_groups(r)])
    members = None
    if plan.survives_engine_loss:  # engines lost and replaced
        if sync.transport == "filesystem":
            def members(transport):
                return FileMembers(rt, spec.directory)
        else:
            def members(transport):
                return EngineMembers(rt, transport.group,
                                     transport.pairs if plan.weight_pairs else None)
    # the engines hold model.dtype; the trainer's master weights may be wider (float32)
    return open_weight_sync(
        "send", spec, sync.bucket_mb, rt.device, sync.solo_mb, model=model, store=rt.store,
        wire_dtype=getattr(torch, rt.cfg.model.dtype), lost_grace_s=sync.dead_peer_s + 5.0,
        publish_metas=lambda metas: rt.store.set(f"wsync/meta/{r}", metas_to_json(metas)),
        adapters=adapter_sync(rt.cfg), members=members,  # model.lora.sync adapters: A and B
        gather_world=rt.layout.trainer_ranks if plan.one_sender else 0)


def engine_transport(rt) -> TransportSpec:
    """This generator rank's end of the weight sync of the launch: receiver 1 + its index
    among the generator ranks, on one plan group per sender (trainer order)."""
    me = 1 + rt.layout.generator_global_ranks.index(rt.role.rank)
    return transport_spec(rt, me, [planned_spec(rt, g)
                                   for g in plan_for(rt).receiver_groups(rt.role.rank)])


def replacement_transport(rt, incarnation: str, first: int, options: dict) -> TransportSpec:
    """A replacement engine's end (launch/join.py): tp rank k receives as receiver 1 + k on
    a group of its own with each sender, [trainer r, its tp ranks] (the filesystem
    transport: the files of the engine it replaces, from sync `first` on)."""
    e, k, tp = rt.role.index, rt.role.tp_rank, rt.layout.tp
    if rt.cfg.sync.transport == "filesystem":
        me = 1 + rt.layout.generator_global_ranks.index(rt.role.rank)
        return transport_spec(rt, me, [], {**options, "first_sync": first})
    return transport_spec(rt, 1 + k, [job_group_spec(rt, join_group_name(r, e, incarnation),
                                                     1 + k, 1 + tp)
                                      for r in range(plan_for(rt).senders)], options)


def sender_metas(rt) -> list[str]:
    """Every sender's shard layout (`wsync/meta/<r>`, JSON), waited for, in sender order:
    what an engine builds its receiver from."""
    return [rt.wait_key(f"wsync/meta/{r}") for r in range(plan_for(rt).senders)]


def announced_version(store, index: int) -> int:
    """Policy version of broadcast number `index`, once announced. A receiver posts its
    receives as soon as it sees the announcement and reads the version while the bytes
    travel: one store round trip less before the transfer starts (~0.2 ms on the 2-core CPU,
    a tenth of a tiny sync); generator/weights.py: Announcements."""
    return int(store.get(f"wsync/version/{index}"))
