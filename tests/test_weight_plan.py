import torch

from llamarl.parallel.weight_plan import (
    TensorMeta,
    metas_from_json,
    metas_to_json,
    model_tensors,
    plan_buckets,
)


def test_buckets_group_by_dtype_and_respect_the_size():
    metas = [TensorMeta("a", "torch.float32", (10,)), TensorMeta("b", "torch.bfloat16", (4, 2)),
             TensorMeta("c", "torch.float32", (30,)), TensorMeta("d", "torch.float32", (100,)),
             TensorMeta("e", "torch.float32", (5,))]
    buckets = plan_buckets(metas, bucket_bytes=40 * 4)
    layout = [(b.dtype, [m.name for m, _ in b.entries], b.numel) for b in buckets]
    assert layout == [("torch.float32", ["d"], 100),  # larger than a bucket: its own, at once
                      ("torch.float32", ["a", "c"], 40),
                      ("torch.float32", ["e"], 5),
                      ("torch.bfloat16", ["b"], 8)]
    offsets = [off for m, off in buckets[1].entries]
    assert offsets == [0, 10]


def test_large_pieces_travel_alone():
    from llamarl.parallel.weight_plan import SOLO_BYTES

    solo = SOLO_BYTES // 4  # float32 elements
    metas = [TensorMeta("big", "torch.float32", (solo,)), TensorMeta("x", "torch.float32", (8,)),
             TensorMeta("almost", "torch.float32", (solo - 1,)),
             TensorMeta("y", "torch.float32", (8,))]
    buckets = plan_buckets(metas, bucket_bytes=4 * SOLO_BYTES)
    assert [[m.name for m, _ in b.entries] for b in buckets] == [["big"], ["x", "almost", "y"]]


def test_meta_json_roundtrip():
    metas = [TensorMeta("x.weight", "torch.float32", (3, 4))]
    assert metas_from_json(metas_to_json(metas)) == metas


def test_tied_parameters_are_sent_once():
    from llamarl.tiny.model import build_model

    model, _ = build_model(0)
    names = list(model_tensors(model))
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(set(names))
    total = sum(t.numel() for t in model_tensors(model).values())
    assert total == sum(p.numel() for p in model.parameters())
    assert all(isinstance(t, torch.Tensor) for t in model_tensors(model).values())


def test_float32_master_weights_travel_in_the_engine_dtype():
    from llamarl.parallel.weight_sender import WeightSender
    from llamarl.tiny.model import build_model

    model, _ = build_model(0)  # float32, as the trainer's master weights
    wide = WeightSender(model, 0, 64, None, torch.device("cpu"))
    narrow = WeightSender(model, 0, 64, None, torch.device("cpu"), wire_dtype=torch.bfloat16)
    assert {m.dtype for m in wide.metas} == {"torch.float32"}
    assert {m.dtype for m in narrow.metas} == {"torch.bfloat16"}
    assert narrow.bytes_per_sync * 2 == wide.bytes_per_sync

    from llamarl.parallel.transports.base import Done, SenderTransport, TransportSpec

    class Nowhere(SenderTransport):  # what the sender packed is checked here, not its travel
        def send(self, tensor, tag, to=None):
            return [(-1, Done())]

    narrow.transport = Nowhere(TransportSpec("nowhere", 0, 1, 1))
    narrow.publish(model, version=None)
    narrow.wait()
    (bucket,) = narrow.buckets
    flat = narrow._flats[0]
    for meta, off in bucket.entries:
        sent = flat[off:off + meta.numel].view(meta.piece_shape)
        expected = dict(model.named_parameters())[meta.name].detach().to(torch.bfloat16)
        assert torch.equal(sent, expected), meta.name


def test_large_pieces_are_sent_from_the_parameter_and_the_optimizer_waits_for_them():
    """A piece that travels alone in the wire dtype is broadcast from the parameter itself (no
    snapshot); `guard` makes the optimizer step wait until that broadcast is done."""
    import llamarl.parallel.weight_sender as ws
    from llamarl.parallel.transports.base import SenderTransport, TransportSpec
    from llamarl.tiny.model import build_model

    model, _ = build_model(0)  # float32
    name, big = max(model.named_parameters(), key=lambda p: p[1].numel())
    # only the largest travel alone
    sender = ws.WeightSender(model, 0, 64, None, torch.device("cpu"),
                             solo_mb=big.numel() * 4 / 2**20)
    (b,) = [i for i, bk in enumerate(sender.buckets) if bk.entries[0][0].name == name]
    assert sender.direct[b] and sender._flats[b] is None
    assert not all(sender.direct)
    events = []

    class Pending:  # a broadcast still in flight until waited for
        def __init__(self, tensor):
            self.tensor = tensor

        def wait(self):
            events.append("sent")

        def get_future(self):
            f = torch.futures.Future()
            f.set_result(None)
            return f

    class Broadcasts(SenderTransport):  # one collective per bucket, as NCCL's
        point_to_point = False

        def send(self, tensor, tag, to=None):
            events.append(tensor.data_ptr())
            return [(-1, Pending(tensor))]

    sender.transport = Broadcasts(TransportSpec("fake", 0, 1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sender.guard(opt)
    sender.publish(model, version=None)
    assert big.data_ptr() in events  # the parameter's own memory, not a copy
    assert "sent" not in events
    big.grad = torch.ones_like(big)
    opt.step()  # waits for every broadcast before changing the parameter
    assert events.count("sent") == len(sender.buckets)
    # the other buckets were snapshots: packed in the send buffers
    assert all(f is not None for f, d in zip(sender._flats, sender.direct) if not d)
