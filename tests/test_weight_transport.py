"""The weight sync's transport on a real gloo pair in one process (group rank 0 = the trainer's
sender, rank 1 = an engine's receives, each in its own thread): every bucket arrives intact
through point-to-point messages posted at once, the optimizer step waits until the shards
sent straight from the parameters have left, and a receiver that posts the next sync's receives
early lets the trainer's send leave while the engine is busy. (Across processes:
tests/test_weight_sync.py.)"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import DIST, ROOT, child_env

from llamarl.parallel.groups import point_to_point, post_from_root, post_to_all
from llamarl.parallel.transports import torch_dist
from llamarl.parallel.transports.torch_dist import Members, Receiver, Sender
from llamarl.parallel.weight_plan import DTYPES_BY_NAME
from llamarl.parallel.weight_receiver import WeightReceiver
from llamarl.parallel.weight_sender import WeightSender
from llamarl.tiny.model import build_model


def _store_server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30),
                         wait_for_workers=False)


def _gloo_ranks(server: dist.TCPStore, size: int) -> list[dist.ProcessGroup]:
    """Ranks 0 and 1 of a gloo group of `size`, built in two threads (construction is a
    rendezvous), each with its own store client; other ranks join from elsewhere."""
    groups = [None, None]

    def join(rank: int) -> None:
        store = server if rank == 0 else dist.TCPStore(
            "127.0.0.1", server.port, None, False, timeout=timedelta(seconds=30))
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("wsync0", store), rank, size,
                                             timedelta(seconds=30))

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(g is not None for g in groups)
    return groups


@pytest.fixture
def gloo_pair():
    """Two ranks of one gloo group."""
    return _gloo_ranks(_store_server(), 2)


def test_messages_pair_by_tag_whatever_the_posting_order(gloo_pair):
    root, engine = gloo_pair
    sent = [torch.arange(10.0) + i for i in range(3)]
    got = [torch.empty(10) for _ in range(3)]
    assert point_to_point(root)  # gloo: point to point
    receives = [post_from_root(engine, got[i], i, p2p=True) for i in (2, 0, 1)]
    sends = [w for i, t in enumerate(sent) for w in post_to_all(root, t, i, p2p=True)]
    for w in receives + sends:
        w.wait()
    assert all(torch.equal(a, b) for a, b in zip(sent, got))


@pytest.mark.parametrize("p2p", [True, False], ids=["point-to-point", "broadcast"])
@pytest.mark.parametrize("alone", [True, False], ids=["some-alone", "one-bucket"])
def test_sync_arrives_intact_and_the_step_waits_until_it_has_left(gloo_pair, monkeypatch,
                                                                    alone, p2p):
    root, engine = gloo_pair
    if not p2p:  # the broadcast path (NCCL's) on the real gloo pair
        monkeypatch.setattr(torch_dist, "point_to_point", lambda group: False)
    model, _ = build_model(0)
    big = max(p.numel() for p in model.parameters())
    # alone: the largest matrices travel alone, straight from the parameters (7 messages);
    # else the whole model is one packed bucket
    solo_mb = big * 4 / 2**20 if alone else None
    sender = WeightSender(model, 0, 64, Sender.over(root), torch.device("cpu"), solo_mb=solo_mb)
    assert any(sender.direct) == alone and not all(sender.direct)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sender.guard(opt)

    sender.publish(model, version=None)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    step = threading.Thread(target=opt.step)
    step.start()
    step.join(0.5)
    # nothing is received yet, so nothing has left: the step must still be waiting
    assert step.is_alive(), "optimizer.step() did not wait for the weight sync in flight"
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())

    bufs = [torch.empty(b.numel, dtype=DTYPES_BY_NAME[b.dtype]) for b in sender.buckets]
    for w in [post_from_root(engine, buf, i, p2p) for i, buf in enumerate(bufs)]:
        w.wait()
    step.join(30)
    assert not step.is_alive()
    for bucket, buf in zip(sender.buckets, bufs):
        for meta, off in bucket.entries:  # the weights of before the step, every one
            assert torch.equal(buf[off:off + meta.numel].view(meta.piece_shape),
                               before[meta.name]), meta.name
    assert not torch.equal(dict(model.named_parameters())[meta.name], before[meta.name])
    assert sender.last_broadcast_s > 0


class LoadingEngine(torch.nn.Module):
    """Stands in for a vLLM model: load_weights copies each (name, tensor) into the parameter
    of that name (a tiny model of its own, other weights to start with)."""

    def __init__(self):
        super().__init__()
        self.inner, _ = build_model(1)

    def load_weights(self, weights) -> None:
        params = dict(self.inner.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)

    def holds(self, model: torch.nn.Module) -> bool:
        """Whether every parameter equals `model`'s of the same name."""
        mine = dict(self.inner.named_parameters())
        return all(torch.equal(mine[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize("p2p", [True, False], ids=["point-to-point", "broadcast"])
def test_next_sync_is_received_while_the_engine_is_busy(gloo_pair, monkeypatch, p2p):
    """On gloo point to point, a receiver whose buckets all go into its receive buffers posts
    the next sync's receives when it loads one: the trainer's next send leaves at once, while
    the engine is busy elsewhere (here: nobody calls the receiver), and the next load finds the
    bytes there. Not on the broadcast path (NCCL's)."""
    root, engine_group = gloo_pair
    if not p2p:
        monkeypatch.setattr(torch_dist, "point_to_point", lambda group: False)
    model, _ = build_model(0)
    sender = WeightSender(model, 0, 64, Sender.over(root), torch.device("cpu"))
    receiver = WeightReceiver([sender.metas], 64, Receiver.over([engine_group]),
                              torch.device("cpu"))
    engine = LoadingEngine()
    receiver.post()
    sender.publish(model, version=None)
    receiver.load(engine)  # the first sync: load_weights, recorded
    sender.wait()
    assert engine.holds(model) and receiver.replay is not None, receiver.problem
    assert receiver._posted_early == p2p

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    sent = threading.Thread(target=lambda: sender.send(model))
    sent.start()
    sent.join(10 if p2p else 0.5)
    assert sent.is_alive() != p2p, "the send leaves at once only if the receives were posted"
    receiver.post()  # nothing to do when posted early
    receiver.load(engine)  # replayed from the receive buffers
    sent.join(30)
    assert not sent.is_alive() and engine.holds(model)


def test_a_trainer_that_quits_after_its_last_sync_is_no_error_until_another_is_announced():
    """The receives posted early for a sync that never comes: posting them fails once the
    trainer process has closed its connection (as it does after its last sync, possibly
    before the generator has loaded it). No error then; an error if another sync is
    announced after all."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    trainer = subprocess.Popen([sys.executable, str(DIST / "quitting_trainer.py")], cwd=ROOT,
                               env=child_env(PORT=store.port))
    try:
        group = dist.ProcessGroupGloo(dist.PrefixStore("wsync0", store), 1, 2,
                                      timedelta(seconds=60))
        model, _ = build_model(0)
        metas = WeightSender(model, 0, 64, None, torch.device("cpu")).metas
        receiver = WeightReceiver([metas], 64, Receiver.over([group]), torch.device("cpu"))
        engine = LoadingEngine()
        receiver.post()
        store.set("go/0", "1")
        receiver.load(engine)  # its load posts the next sync's receives early
        assert receiver._posted_early
        store.set("go/1", "1")
        assert trainer.wait(60) == 0  # it sent the last sync and quit
        time.sleep(0.5)  # gloo notices the closed connection (at once, but on its own thread)
        receiver.post()
        receiver.load(engine)  # the bytes were there; posting the next receives fails
        assert engine.holds(model)
        assert receiver._early_error is not None
        with pytest.raises(RuntimeError, match="closed its connection before announcing"):
            receiver.post()  # another sync announced after all: now it is an error
    finally:
        trainer.kill()


_DYING_RECEIVER = """
import os, sys, torch.distributed as dist
from datetime import timedelta
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, False, timeout=timedelta(seconds=30))
dist.ProcessGroupGloo(dist.PrefixStore("wsync0", store), 2, 3, timedelta(seconds=30))
os._exit(9)  # an engine killed after the group was built
"""


class _Members(Members):
    """Receivers 1 and 2 of the group; 2 is declared lost once `lost_now` is set."""

    def __init__(self, group):
        super().__init__(lambda: group)
        self.lost_now = threading.Event()

    def lost(self) -> set[int]:
        return {2} if self.lost_now.is_set() else set()


@pytest.mark.parametrize("declared", [True, False], ids=["declared-lost", "never-declared"])
def test_a_dead_receiver_is_left_out_once_it_is_declared_lost(declared):
    """A sync to a receiver whose process died (gloo: the send fails) completes for the
    others and is forgiven once the roster declares it lost; a failure nobody explains within
    the grace is an error, not a hang."""
    server = _store_server()
    dying = subprocess.Popen([sys.executable, "-c", _DYING_RECEIVER, str(server.port)])
    root, engine = _gloo_ranks(server, 3)
    assert dying.wait(60) == 9
    model, _ = build_model(0)
    members = _Members(root)
    sender = WeightSender(model, 0, 64, Sender.over(root, members), torch.device("cpu"),
                          lost_grace_s=1.0)
    if declared:
        threading.Timer(0.3, members.lost_now.set).start()  # the watchdog's word, later
    sender.publish(model, version=None)
    bufs = [torch.empty(b.numel, dtype=DTYPES_BY_NAME[b.dtype]) for b in sender.buckets]
    for w in [post_from_root(engine, buf, i, True) for i, buf in enumerate(bufs)]:
        w.wait()  # receiver 1 gets the whole sync
    t0 = time.monotonic()
    if declared:
        sender.wait()
        sender.publish(model, version=None)  # the next sync leaves receiver 2 out at once
        for w in [post_from_root(engine, buf, i, True) for i, buf in enumerate(bufs)]:
            w.wait()
        sender.wait()
    else:
        with pytest.raises(RuntimeError, match="weight broadcast failed"):
            sender.wait()
    assert time.monotonic() - t0 < 10


class RecordingTransport(torch_dist.ReceiverTransport):
    """Records the order of posts and waits of a receiver's messages (each completes at once)."""

    def __init__(self, senders: int, ordered: bool):
        from llamarl.parallel.transports.base import TransportSpec

        super().__init__(TransportSpec("torch", 1, senders, 1))
        self.ordered, self.posts_early, self.events = ordered, not ordered, []

    def receive(self, tensor, sender, tag, own=False):
        self.events.append(("post", sender, tag))
        events = self.events

        class Recorded:
            def wait(self):
                events.append(("wait", sender, tag))
                return True
        return Recorded()


@pytest.mark.parametrize("ordered", [True, False], ids=["broadcasts", "point-to-point"])
def test_broadcast_receives_are_posted_sender_by_sender(ordered):
    """On NCCL (ordered) an engine posts sender s + 1's receives only once every receive of
    sender s has been waited for: one weight communicator at a time on its GPU, in the same
    order on every engine (docs/architecture.md, NCCL order). Point to point: all at once."""
    from llamarl.parallel.weight_plan import TensorMeta

    metas = [[TensorMeta(f"w{i}", "torch.float32", (4, 256), 2, 2 * s) for i in range(3)]
             for s in range(2)]
    transport = RecordingTransport(2, ordered)
    receiver = WeightReceiver(metas, 0, transport, torch.device("cpu"), solo_mb=0.001)
    assert all(len(plan) == 3 for plan in receiver.plans)
    receiver.post()
    events = transport.events
    first_of_1 = events.index(("post", 1, 0))
    sender0 = [i for i, e in enumerate(events) if e[1] == 0]
    if ordered:
        waits0 = [i for i, e in enumerate(events) if e[0] == "wait" and e[1] == 0]
        assert len(waits0) == 3 and max(waits0) < first_of_1, events
    else:
        assert max(sender0) > first_of_1 and not any(e[0] == "wait" for e in events), events
