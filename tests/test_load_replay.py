"""Recording an engine's load_weights and replaying it as copies (llamarl/parallel/load_replay).

The fake engine below loads like vLLM's Qwen2 (q/k/v rows into one fused qkv weight, a
vocabulary padded with zero rows, tensor-parallel column slices); the real vLLM engine is
covered by tests/test_weight_sync.py."""

import pytest
import torch

from llamarl.parallel.load_replay import LoadRecorder, first_overlap, split_rows


class FusedEngine(torch.nn.Module):
    """qkv = [q; k; v] (rows 0-3, 4-5, 6-7), embed = 3 vocab rows padded to 4 with zeros,
    and o = the columns [tp_rank * 2, tp_rank * 2 + 2) of a (2, 4) weight."""

    def __init__(self, tp_rank: int = 0, loader: str = "copy"):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(8, 3), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.full((4, 3), 7.0), requires_grad=False)
        self.o = torch.nn.Parameter(torch.zeros(2, 2), requires_grad=False)
        self.tp_rank, self.loader = tp_rank, loader

    def load_weights(self, weights):
        rows = {"q": (0, 4), "k": (4, 2), "v": (6, 2)}
        for name, w in weights:
            if name in rows:
                start, n = rows[name]
                if self.loader == "cast":
                    w = w.to(torch.float64).to(torch.float32)
                self.qkv.data.narrow(0, start, n).copy_(w)
            elif name == "embed":
                self.embed.data[:w.shape[0]].copy_(w)
                self.embed.data[w.shape[0]:].fill_(0)
            elif name == "o":
                self.o.data.copy_(w.narrow(1, self.tp_rank * 2, 2))
                if self.loader == "replace":  # e.g. a re-layout after loading
                    self.o.data = self.o.data.clone()


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (4, 3), "k": (2, 3), "v": (2, 3), "embed": (3, 3), "o": (2, 4)}
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def record(engine, received: dict[str, torch.Tensor]) -> LoadRecorder:
    recorder = LoadRecorder(list(engine.parameters()), list(received.values()))
    with recorder:
        engine.load_weights(received.items())
    return recorder


def replay(recorder: LoadRecorder) -> None:
    for dst, value in recorder.fills:
        dst.fill_(value)
    torch._foreach_copy_([d for d, _ in recorder.copies], [s for _, s in recorder.copies])


def test_replay_with_new_data_matches_load_weights():
    engine, reference = FusedEngine(tp_rank=1), FusedEngine(tp_rank=1)
    received = checkpoint(0)  # the receive buffers
    recorder = record(engine, received)
    assert recorder.problem is None
    assert len(recorder.copies) == 5 and len(recorder.fills) == 1
    for name, t in checkpoint(1).items():  # the next sync lands in the same buffers
        received[name].copy_(t)
    engine.embed.data[3] = 5.0  # the padding row must be zeroed again by the replay
    replay(recorder)
    reference.load_weights(checkpoint(1).items())
    for name, p in engine.named_parameters():
        assert torch.equal(p, dict(reference.named_parameters())[name]), name
    assert torch.equal(engine.o, checkpoint(1)["o"][:, 2:4])  # rank 1's columns
    assert torch.equal(engine.embed[3], torch.zeros(3))


def test_arithmetic_on_received_data_is_not_replayable():
    recorder = record(FusedEngine(loader="cast"), checkpoint(0))
    assert recorder.problem is not None and "computes with a received tensor" in recorder.problem


def test_replacing_an_engine_storage_is_not_replayable():
    recorder = record(FusedEngine(loader="replace"), checkpoint(0))
    assert recorder.problem == "load_weights replaced the storage of an engine tensor"


def test_overlap_is_found_by_memory_span():
    base = torch.zeros(4, 4)
    assert first_overlap([base[0:2], base[2:4]]) is None
    assert first_overlap([base[0:2], base[1:3]]) == ((2, 4), (2, 4))
    assert first_overlap([base[0:2], torch.zeros(2, 4)]) is None  # another storage


def test_split_rows_by_hand():
    # full (4, 3) = arange(12); sender 0 holds rows 0-1 in buffer a, sender 1 rows 2-3 in
    # buffer b (at element offset 1). src = full[1:4, 1:3]: rows 1, 2, 3, columns 1-2.
    full = torch.arange(12.0).view(4, 3)
    a = full[:2].clone().view(-1)
    b = torch.cat([torch.tensor([-1.0]), full[2:].reshape(-1)])
    pieces = [("a", 0, a.view(2, 3)), ("b", 2, b[1:].view(2, 3))]
    dst = torch.zeros(3, 2)
    parts = split_rows(dst, full[1:4, 1:3], full, pieces)
    assert [(k, tuple(d.shape)) for k, d, _ in parts] == [("a", (1, 2)), ("b", (2, 2))]
    assert parts[0][2].tolist() == [[4.0, 5.0]]  # row 1 of full, from a
    assert parts[1][2].tolist() == [[7.0, 8.0], [10.0, 11.0]]  # rows 2-3, from b
    for _, d, s in parts:
        d.copy_(s)
    assert torch.equal(dst, full[1:4, 1:3])


def test_split_rows_refuses_views_across_rows():
    full = torch.arange(12.0).view(4, 3)
    pieces = [("a", 0, full[:2]), ("b", 2, full[2:])]
    flat = full.view(-1)[2:8]  # 1-D: its dim 0 is not the rows of full
    assert split_rows(torch.zeros(6), flat, full, pieces) is None
    assert split_rows(torch.zeros(2, 4), full.t()[:2], full, pieces) is None  # transposed


class LoopbackTransport:
    """Stands in for the receiving end of a transport in one process: a receive fills its
    buffer with what the sender packed (the real transports: tests/test_weight_sync.py,
    tests/test_weight_transport.py). The outboxes are per sender."""

    posts_early = False
    ordered = False  # (ReceiverTransport's attributes: one sender's receives need no order)

    def __init__(self, senders: int):
        from llamarl.parallel.transports.base import TransportSpec

        self.spec = TransportSpec("loopback", 1, senders, 1)
        self.outbox: list[list[torch.Tensor]] = [[] for _ in range(senders)]

    def begin(self):
        pass

    def receive(self, tensor, sender, tag, own=False):
        tensor.copy_(self.outbox[sender].pop(0))
        return self

    def wait(self):
        return True


@pytest.mark.parametrize("bucket_mb", [0, 1])
def test_receiver_replays_rows_received_in_place_or_into_buffers(bucket_mb):
    """bucket_mb = 0: a bucket per piece, most received straight into the engine; 1: one
    bucket per sender, received into its buffer and copied out."""
    from llamarl.parallel.weight_plan import TensorMeta
    from llamarl.parallel.weight_receiver import WeightReceiver

    shapes = {"q": (4, 3), "k": (2, 3), "v": (2, 3), "embed": (3, 3), "o": (2, 4)}
    # Two senders split every tensor's rows (sender 0 takes the first ceil(rows / 2));
    # bucket_mb = 0 gives every tensor piece a bucket of its own: 5 buckets per sender.
    metas = [[], []]
    for name, shape in shapes.items():
        half = -(-shape[0] // 2)
        metas[0].append(TensorMeta(name, "torch.float32", shape, half, 0))
        metas[1].append(TensorMeta(name, "torch.float32", shape, shape[0] - half, half))
    transport = LoopbackTransport(2)
    receiver = WeightReceiver(metas, bucket_mb, transport, torch.device("cpu"))

    def send(ckpt):
        for s in range(2):
            for bucket in receiver.plans[s]:
                flat = torch.empty(bucket.numel)
                for meta, off in bucket.entries:
                    rows = ckpt[meta.name][meta.row0:meta.row0 + meta.local_rows]
                    flat[off:off + meta.numel] = rows.reshape(-1)
                transport.outbox[s].append(flat)

    engine = FusedEngine(tp_rank=1)
    for seed in (0, 1, 2):  # records on the first sync, replays on the others
        send(checkpoint(seed))
        assert receiver.receive(engine) == len(shapes)
        reference = FusedEngine(tp_rank=1)
        reference.load_weights(checkpoint(seed).items())
        for (name, p), q in zip(engine.named_parameters(), reference.parameters()):
            assert torch.equal(p, q), (seed, name)
        assert receiver.replay is not None, receiver.problem
    if bucket_mb == 0:
        assert [len(plan) for plan in receiver.plans] == [5, 5]
        # q, k, v and embed rows land in place (received straight into the engine); o is a
        # column slice (tensor parallel rank 1) of what arrives: copied out of its buffer.
        in_place = [[t is not f for t, f in zip(ts, fs)]
                    for ts, fs in zip(receiver.targets, receiver.flats)]
        assert in_place == [[True, True, True, True, False]] * 2
    else:
        assert [len(plan) for plan in receiver.plans] == [1, 1]
        assert receiver.targets is receiver.flats  # nothing in place

    # The engine's storage moves (as vLLM's sleep mode would do): the receiver notices (before
    # posting the next receives if some go straight into the engine, else before copying),
    # records the load again, and the weights are still right.
    engine.qkv.data = torch.zeros(8, 3)
    engine.embed.data = torch.full((4, 3), 7.0)  # its padding row must be zeroed again
    send(checkpoint(3))
    receiver.post()
    assert receiver.targets is receiver.flats  # not into the old engine storage
    receiver.load(engine)
    reference = FusedEngine(tp_rank=1)
    reference.load_weights(checkpoint(3).items())
    for (name, p), q in zip(engine.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    assert receiver.replay is not None and receiver.watch[0][1] == engine.qkv.data_ptr()
