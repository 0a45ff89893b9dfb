"""Trainer -> generator weight sync: every trainer rank sends its own FSDP2 shard. One factory,
`open_weight_sync`, opens either end, as buffer.open_channel does for rollouts.

    weight_plan.py     what each trainer rank sends, and its buckets (one message each)
    weight_sender.py   packing a rank's shards into the buckets and sending them
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

import torch

from llamarl.parallel.transports import transport_module
from llamarl.parallel.transports.base import TransportSpec
from llamarl.parallel.weight_plan import TensorMeta
from llamarl.parallel.weight_receiver import WeightReceiver
from llamarl.parallel.weight_sender import WeightSender


def open_weight_sync(side: str, spec: TransportSpec, bucket_mb: int, device: torch.device,
                     solo_mb: float | None = None, *, model: torch.nn.Module | None = None,
                     store=None, wire_dtype: torch.dtype | None = None,
                     lost_grace_s: float = 0.0,
                     publish_metas: Callable[[list[TensorMeta]], None] | None = None,
                     metas: list[list[TensorMeta]] | None = None,
                     adapters: bool = False,
                     ) -> WeightSender | WeightReceiver:
    """Open one end of a weight sync over transport `spec.name` (sync.transport).

    side "send" (trainer rank spec.me): a WeightSender of `model`'s shards. Its shard layout
    goes to `publish_metas` before the transport connects (the receivers need every layout
    to build their end, and a torch group is built by all its members at once).
    side "receive" (an engine): a WeightReceiver of the senders' layouts `metas`.
    `adapters` (model.lora.sync adapters): a LoRA policy's adapters alone are sent, and
    received for an adapter of vLLM's (generator/lora_adapter.py), not the engine's weights
    (no recorded replay, no resharding)."""
    transport = transport_module(spec.name)
    if side == "send":
        assert model is not None
        sender = WeightSender(model, spec.me, bucket_mb, None, device, store,
                              wire_dtype=wire_dtype, solo_mb=solo_mb, lost_grace_s=lost_grace_s,
                              adapters=adapters)
        if publish_metas is not None:
            publish_metas(sender.metas)
        sender.transport = transport.Sender(spec)
        return sender
    assert side == "receive" and metas is not None, side
    return WeightReceiver(metas, bucket_mb, transport.Receiver(spec), device, solo_mb,
                          replay=not adapters)


def announced_version(store, index: int) -> int:
    """Policy version of broadcast number `index`, once announced. A receiver posts its
    receives as soon as it sees the announcement and reads the version while the bytes
    travel: one store round trip less before the transfer starts (~0.2 ms on the 2-core CPU,
    a tenth of a tiny sync); generator/weights.py: Announcements."""
    return int(store.get(f"wsync/version/{index}"))
