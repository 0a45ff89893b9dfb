"""A pool of receive buffers for one sender's syncs (llamarl/parallel/receive_pool.py,
WeightReceiver with receive_buffers): weights bit-identical to a buffer per bucket, and never
more than K buckets' buffers, on the loopback transport (by hand) and on a real gloo pair."""

from __future__ import annotations

import threading

import pytest
import torch
from test_load_replay import FusedEngine, LoopbackTransport, checkpoint
from test_weight_transport import LoadingEngine, _gloo_ranks, _store_server

from llamarl.parallel import receive_pool
from llamarl.parallel.receive_pool import ReceivePool, slot_sizes
from llamarl.parallel.transports import torch_dist
from llamarl.parallel.transports.torch_dist import Receiver, Sender
from llamarl.parallel.weight_plan import Bucket, TensorMeta, plan_buckets
from llamarl.parallel.weight_receiver import WeightReceiver
from llamarl.parallel.weight_sender import WeightSender
from llamarl.tiny.model import build_model

SHAPES = {"q": (4, 3), "k": (2, 3), "v": (2, 3), "embed": (3, 3), "o": (2, 4)}


def _bucket(numel: int, dtype: str = "torch.float32") -> Bucket:
    return Bucket(dtype, ((TensorMeta("w", dtype, (numel,)), 0),), numel)


def test_slot_sizes_by_hand():
    # buckets of 40, 8, 12, 100, 4 bytes (float32 10, 2, 3, 25, 1): slots 0, 1, 0, 1, 0
    plan = [_bucket(n) for n in (10, 2, 3, 25, 1)]
    assert slot_sizes(plan, 2) == [40, 100]
    assert slot_sizes(plan, 3) == [100, 8, 12]
    assert slot_sizes(plan, 8) == [40, 8, 12, 100, 4]  # K >= buckets: a buffer per bucket
    # bucket 3 received in place: the others take slots 0, 1, 0, 1
    assert slot_sizes(plan, 2, [False, False, False, True, False]) == [40, 8]
    assert slot_sizes([_bucket(4, "torch.bfloat16")], 2) == [8]


class CountingTransport(LoopbackTransport):
    """Loopback, counting the receives posted into a pool slot and not yet waited for."""

    def __init__(self):
        super().__init__(1)
        self.slots: set[int] = set()
        self.pending, self.most = 0, 0

    def receive(self, tensor, sender, tag, own=False):
        into_slot = any(tensor.untyped_storage().data_ptr() == s for s in self.slots)
        super().receive(tensor, sender, tag, own)
        self.pending += into_slot
        self.most = max(self.most, self.pending)
        transport, done = self, [into_slot]

        class Posted:
            def wait(self):
                transport.pending -= done.pop() if done else 0
                return True
        return Posted()


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_two_buffers_for_five_buckets_load_as_a_buffer_per_bucket(tp_rank):
    """Five buckets (a tensor each), K = 2, four syncs: the first records the fused engine's
    load bucket by bucket (q, k, v land in one qkv parameter from three calls; embed's padding
    row is zeroed), the others replay it. Weights equal a full load_weights bit for bit, at
    most 2 receives are pending into the pool, and after the first sync only o (a column
    slice on tp rank 1, the whole of it on 0) needs a buffer."""
    metas = [[TensorMeta(n, "torch.float32", s) for n, s in SHAPES.items()]]
    transport = CountingTransport()
    receiver = WeightReceiver(metas, 0, transport, torch.device("cpu"), receive_buffers=2)
    assert receiver.pool is not None and len(receiver.plans[0]) == 5
    largest = max(b.numel * 4 for b in receiver.plans[0])
    engine = FusedEngine(tp_rank=tp_rank)
    for seed in range(4):
        transport.slots = {s.untyped_storage().data_ptr() for s in receiver.pool.slots}
        for bucket in receiver.plans[0]:
            (meta, _), = bucket.entries
            transport.outbox[0].append(checkpoint(seed)[meta.name].reshape(-1))
        assert receiver.receive(engine) == 5
        reference = FusedEngine(tp_rank=tp_rank)
        reference.load_weights(checkpoint(seed).items())
        for (name, p), q in zip(engine.named_parameters(), reference.parameters()):
            assert torch.equal(p, q), (seed, name)
        assert receiver.replay is not None, receiver.problem
        assert transport.most <= 2 and receiver.buffer_bytes <= 2 * largest
    assert receiver.peak_buffer_bytes <= 2 * largest
    # later syncs: q, k, v, embed straight into the engine; o copied from the one slot
    assert receiver.pool.slot_of == [None, None, None, None, 0]
    assert receiver.buffer_bytes == 2 * 4 * 4

    # The engine's storage moves (as vLLM's sleep mode would): before posting, the receiver
    # goes back to a slot per bucket in turn, records again, and the weights are still right.
    engine.qkv.data = torch.zeros(8, 3)
    engine.embed.data = torch.full((4, 3), 7.0)
    for bucket in receiver.plans[0]:
        transport.outbox[0].append(checkpoint(9)[bucket.entries[0][0].name].reshape(-1))
    receiver.post()
    assert receiver.pool.slot_of == [0, 1, 0, 1, 0]
    receiver.load(engine)
    reference = FusedEngine(tp_rank=tp_rank)
    reference.load_weights(checkpoint(9).items())
    for (name, p), q in zip(engine.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    assert receiver.pool.slot_of == [None, None, None, None, 0]


def test_a_load_that_keeps_a_tensor_across_calls_is_an_error():
    """A loader that copies each tensor only at its next call read a buffer that the next
    bucket may have overwritten: the first sync says so, naming the fix."""

    class Deferring(FusedEngine):
        kept: list = []

        def load_weights(self, weights):
            super().load_weights(self.kept)
            self.kept = list(weights)

    metas = [[TensorMeta(n, "torch.float32", s) for n, s in SHAPES.items()]]
    transport = LoopbackTransport(1)
    receiver = WeightReceiver(metas, 0, transport, torch.device("cpu"), receive_buffers=2)
    for bucket in receiver.plans[0]:
        transport.outbox[0].append(checkpoint(0)[bucket.entries[0][0].name].reshape(-1))
    with pytest.raises(RuntimeError, match="sync.receive_buffers=0"):
        receiver.receive(Deferring())


def test_several_senders_keep_a_buffer_per_bucket():
    metas = [[TensorMeta("w", "torch.float32", (4, 3), 2, 2 * s)] for s in range(2)]
    receiver = WeightReceiver(metas, 0, LoopbackTransport(2), torch.device("cpu"),
                              receive_buffers=2)
    assert receiver.pool is None and receiver.buffer_bytes == 2 * 6 * 4


class StridedEngine(LoadingEngine):
    """Every matrix of the engine lives in a buffer one column wider (a strided view): its
    copies come out of the receive buffers; vectors are received in place (`vectors`
    strided too: nothing is)."""

    def __init__(self, vectors: bool = False):
        super().__init__()
        for module in self.inner.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if p.dim() == 2:
                    wide = torch.zeros(p.shape[0], p.shape[1] + 1)
                    view = wide[:, :-1]
                elif vectors:
                    view = torch.zeros(2 * p.shape[0])[::2]
                else:
                    continue
                view.copy_(p.detach())
                setattr(module, name, torch.nn.Parameter(view, requires_grad=False))


@pytest.mark.parametrize("vectors", [False, True], ids=["some-in-place", "none-in-place"])
@pytest.mark.parametrize("p2p", [True, False], ids=["point-to-point", "broadcast"])
def test_gloo_syncs_through_two_buffers(monkeypatch, p2p, vectors):
    """The tiny model, every tensor a bucket of its own (26), through a real gloo pair into
    K = 2 buffers, three syncs: the engine holds the trainer's weights after each, and the
    receive buffers never exceed 2 x the largest bucket. With nothing received in place,
    point to point, the next sync's first receives are posted by the last load (early) and
    the rest as the load frees buffers; on the broadcast path (NCCL's) not."""
    if not p2p:
        monkeypatch.setattr(torch_dist, "point_to_point", lambda group: False)
    root, engine_group = _gloo_ranks(_store_server(), 2)
    model, _ = build_model(0)
    # bucket_mb 0: every piece a bucket of its own, sent straight from the parameters
    sender = WeightSender(model, 0, 0, Sender.over(root), torch.device("cpu"))
    receiver = WeightReceiver([sender.metas], 0, Receiver.over([engine_group]),
                              torch.device("cpu"), receive_buffers=2)
    plan = receiver.plans[0]
    assert len(plan) >= 5 and plan == plan_buckets(sender.metas, 0)
    largest = max(b.numel * 4 for b in plan)
    engine = StridedEngine(vectors)
    peak = []
    real_start = ReceivePool.start

    def start(pool, transport):  # the pool's bytes whenever a sync starts
        peak.append(pool.bytes)
        real_start(pool, transport)
    monkeypatch.setattr(receive_pool.ReceivePool, "start", start)
    for sync in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5 + sync)
        sent = threading.Thread(target=lambda: (sender.publish(model, None), sender.wait()))
        sent.start()
        receiver.receive(engine)
        sent.join(60)
        assert not sent.is_alive() and engine.holds(model), sync
        assert receiver.replay is not None, receiver.problem
    assert max(peak) <= receiver.peak_buffer_bytes <= 2 * largest
    assert receiver.pool.in_place != vectors
    assert not all(s is None for s in receiver.pool.slot_of)
    assert receiver._posted_early == (p2p and vectors)  # never into the engine early
