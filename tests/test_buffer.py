"""Rollout records and the shared-memory channel, across real processes."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from llamarl.buffer.record import RolloutBatch, split_groups
from llamarl.buffer.shm import SHM_DIR, ShmChannel, segment_prefix, sweep_run


def make_batch(n_groups: int, group_size: int, seed: int, version: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    prompts, comps, lps, rewards, gids, fin = [], [], [], [], [], []
    for grp in range(n_groups):
        prompt = torch.randint(4, 30, (int(torch.randint(2, 6, (1,), generator=g)),),
                               generator=g).tolist()
        for _ in range(group_size):
            n = int(torch.randint(0, 7, (1,), generator=g))
            comps.append(torch.randint(4, 30, (n,), generator=g).tolist())
            lps.append((-torch.rand(n, generator=g)).tolist())
            prompts.append(prompt)
            rewards.append(float(torch.rand(1, generator=g)))
            gids.append(1000 * seed + grp)
            fin.append(n % 2 == 0)
    return RolloutBatch.from_lists(prompts, comps, lps, rewards, gids, fin, version, 3,
                                   {"seed": seed})


def same(a: RolloutBatch, b: RolloutBatch) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.columns().values(), b.columns().values()))


def test_split_keeps_groups_whole_and_even():
    batch = make_batch(6, 4, seed=1)
    parts = split_groups(batch, 3)
    assert [len(p) for p in parts] == [8, 8, 8]
    seen = set()
    for p in parts:
        gids = set(p.group_ids.tolist())
        assert not gids & seen
        seen |= gids
        assert all((p.group_ids == g).sum() == 4 for g in gids)
    assert same(RolloutBatch.concat(parts), batch)


def test_split_rejects_uneven():
    with pytest.raises(ValueError, match="do not split evenly"):
        split_groups(make_batch(5, 2, seed=2), 2)


def test_per_token_record_of_single_turn_samples():
    batch = RolloutBatch.from_lists([[1, 2, 3], [1, 2, 3]], [[7, 8], []], [[-0.5, -0.25], []],
                                    [1.0, 0.0], [5, 5], [True, False], 4, 2)
    assert batch.token_ids.tolist() == [1, 2, 3, 7, 8, 1, 2, 3]
    assert batch.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 0]
    assert batch.logprobs.tolist() == [0, 0, 0, -0.5, -0.25, 0, 0, 0]
    assert batch.token_version.tolist() == [-1, -1, -1, 4, 4, -1, -1, -1]
    assert batch.seq_lens.tolist() == [5, 3] and batch.prompt_lens.tolist() == [3, 3]
    assert batch.sampled_tokens().tolist() == [2, 0]
    assert batch.finished.tolist() == [True, False] and batch.turns.tolist() == [1, 1]
    assert batch.policy_version.tolist() == [4, 4]
    assert [r.tolist() for r in batch.rows()] == [[1, 2, 3, 7, 8], [1, 2, 3]]


def test_select_and_slice_match_a_per_row_rebuild():
    batch = make_batch(3, 4, seed=4)
    rows = [7, 0, 11, 3]
    sub = batch.select(torch.tensor(rows))
    by_row = batch.rows()
    assert [r.tolist() for r in sub.rows()] == [by_row[i].tolist() for i in rows]
    assert sub.rewards.tolist() == batch.rewards[rows].tolist()
    cut = batch.slice(2, 9)
    assert same(cut, batch.select(torch.arange(2, 9)))
    assert same(RolloutBatch.concat([batch.slice(0, 5), batch.slice(5, 12)]), batch)


def test_multi_turn_sample_masks_observations_and_keeps_versions():
    from llamarl.buffer.record import Sample

    s = Sample(finish="max_turns")
    s.add_context([1, 2])  # prompt
    s.add_sampled([5, 6], [-0.1, -0.2], version=3)
    s.add_context([9, 9, 9])  # tool output
    s.add_sampled([7], [-0.3], version=4)
    batch = RolloutBatch.from_samples([s], [1.0], [0], generator=1)
    assert batch.loss_mask.tolist() == [0, 0, 1, 1, 0, 0, 0, 1]
    assert batch.token_version.tolist() == [-1, -1, 3, 3, -1, -1, -1, 4]
    assert batch.prompt_lens.tolist() == [2] and batch.turns.tolist() == [2]
    assert batch.policy_version.tolist() == [3]  # the oldest sampled token
    assert batch.finished.tolist() == [False]


def _store(port: int, master: bool):
    return dist.TCPStore("127.0.0.1", port, None, master, timeout=timedelta(seconds=30),
                         wait_for_workers=False)


def _producer(port: int, run_id: str, n: int, capacity: int, q):
    ch = ShmChannel(_store(port, False), run_id, "e0t0", capacity)
    for i in range(n):
        ch.put(make_batch(4, 2, seed=i, version=i))
        q.put(("put", i, time.monotonic()))
    ch.close(drain_timeout_s=60)


def test_channel_moves_batches_in_order_with_backpressure_and_cleans_up():
    run_id = f"test{time.monotonic_ns()}"
    server = _store(0, True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    prod = ctx.Process(target=_producer, args=(server.port, run_id, 5, 2, q))
    prod.start()
    try:
        # Nobody consumes yet: the producer must stop after `capacity` batches.
        events = [q.get(timeout=60) for _ in range(2)]
        time.sleep(1.0)
        assert q.empty(), "producer ran past the buffer capacity"
        assert len(list(SHM_DIR.glob(segment_prefix(run_id) + "*"))) == 2
        consumer = ShmChannel(_store(server.port, False), run_id, "e0t0", 2)
        got = [consumer.get() for _ in range(5)]
        for i, b in enumerate(got):
            assert same(b, make_batch(4, 2, seed=i, version=i))
            assert b.info == {"seed": i}
        events += [q.get(timeout=30) for _ in range(3)]
        assert [e[1] for e in events] == list(range(5))
        prod.join(30)
        assert prod.exitcode == 0
        assert not list(SHM_DIR.glob(segment_prefix(run_id) + "*"))
    finally:
        prod.kill()
        sweep_run(run_id)


class _CountingStore:
    """A store client that counts its queue_len calls (the consumer's looks at its queue)."""

    def __init__(self, store):
        self.store, self.looks = store, 0

    def queue_len(self, key):
        self.looks += 1
        return self.store.queue_len(key)

    def __getattr__(self, name):
        return getattr(self.store, name)


def _put_later(port: int, run_id: str, delays: list[float]):
    ch = ShmChannel(_store(port, False), run_id, "e0t3", 4)
    for i, delay in enumerate(delays):
        time.sleep(delay)
        ch.put(make_batch(2, 2, seed=i, version=i))
    ch.close(drain_timeout_s=60)


def test_consumer_waits_for_a_push_without_polling_the_store():
    """With a store connection for its waker (as the trainer's channels have), a waiting
    consumer looks at its queue every WAKED_POLL_S and when the producer's push wakes it, not
    every POLL_S (2 ms: ~5% of a core in the consumer and more in the store's server, taken
    from the engines while they generate). Every batch arrives, in order, and the waker deletes
    the keys that marked the pushes."""
    run_id = f"test{time.monotonic_ns()}"
    server = _store(0, True)
    counting = _CountingStore(_store(server.port, False))
    consumer = ShmChannel(counting, run_id, "e0t3", 4,
                          make_store=lambda: _store(server.port, False))
    prod = mp.get_context("spawn").Process(target=_put_later,
                                           args=(server.port, run_id, [1.0, 1.0, 0.0]))
    prod.start()
    try:
        t0 = time.monotonic()
        got = [consumer.get() for _ in range(3)]
        waited = time.monotonic() - t0
        assert [b.info for b in got] == [{"seed": i} for i in range(3)]
        assert waited >= 1.5  # (the producer's start, then two 1 s pauses)
        # ~2 s of waiting: at most one look per WAKED_POLL_S and one per wake (polling every
        # 2 ms made ~1000)
        assert counting.looks <= waited / 0.05 + 10, counting.looks
        prod.join(30)
        assert prod.exitcode == 0
        deadline = time.monotonic() + 10
        while server.check([f"{consumer.queue_key}/pushed/2"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(server.check([f"{consumer.queue_key}/pushed/{i}"]) for i in range(3))
    finally:
        prod.kill()
        sweep_run(run_id)


def test_producer_close_unlinks_unconsumed_segments():
    run_id = f"test{time.monotonic_ns()}"
    server = _store(0, True)
    ch = ShmChannel(server, run_id, "e0t1", 4)
    ch.put(make_batch(2, 2, seed=0))
    ch.put(make_batch(2, 2, seed=1))
    assert len(list(SHM_DIR.glob(segment_prefix(run_id) + "*"))) == 2
    assert ch.unconsumed() == 2
    ShmChannel(server, run_id, "e0t1", 4).get()  # the consumer takes one
    assert ch.unconsumed() == 1
    ch.close()
    assert not list(SHM_DIR.glob(segment_prefix(run_id) + "*"))


def test_adopting_a_channel_while_its_consumer_reads_a_batch():
    """An engine takes over a lost engine's channel (Channel.adopt) while the trainer has popped
    batch 1's descriptor and not yet acked it. The takeover must neither count batch 1's
    number as free (it released that segment as "never published" before: the trainer's read
    failed with FileNotFoundError) nor reuse it; a segment the lost producer was writing (under
    its temporary name) is released."""
    import threading

    run_id = f"test{time.monotonic_ns()}"
    server = _store(0, True)
    lost = ShmChannel(server, run_id, "e1t0", 4)
    lost.put(make_batch(2, 2, seed=0))
    lost.put(make_batch(2, 2, seed=1))
    trainer = ShmChannel(server, run_id, "e1t0", 4)
    try:
        assert same(trainer.get(), make_batch(2, 2, seed=0))
        desc = json.loads(server.queue_pop(trainer.queue_key, False))  # batch 1: popped...
        taker = ShmChannel(server, run_id, "e1t0", 4)
        carried = []
        adopting = threading.Thread(target=lambda: carried.append(taker.adopt()))
        adopting.start()
        time.sleep(0.3)  # ...and read only now
        batch = trainer._receive(desc)
        server.add(trainer.acked_key, 1)
        trainer._consumed(desc)
        adopting.join(10)
        assert same(batch, make_batch(2, 2, seed=1)) and carried == [2]
        taker.put(make_batch(2, 2, seed=2))  # numbered 2, after both
        assert same(trainer.get(), make_batch(2, 2, seed=2))

        # the consumer finishes (ack, unlink) between the taker's read of the count and its
        # look at the payload (a clean-clone run hit this): the number must still move on
        taker.put(make_batch(2, 2, seed=3))  # batch 3
        desc = json.loads(server.queue_pop(trainer.queue_key, False))
        racing = ShmChannel(server, run_id, "e1t0", 4)
        look = racing._exists

        def finish_then_look(path):
            if not racing.finished:
                racing.finished = trainer._receive(desc)
                server.add(trainer.acked_key, 1)
                trainer._consumed(desc)
            return look(path)

        racing.finished, racing._exists = None, finish_then_look
        assert racing.adopt() == 4 and same(racing.finished, make_batch(2, 2, seed=3))

        # a segment the lost producer was writing, never published: released by the taker
        (SHM_DIR / f"{segment_prefix(run_id)}e1t0_4.tmp").write_bytes(b"partial")
        assert ShmChannel(server, run_id, "e1t0", 4).adopt() == 4
        assert not list(SHM_DIR.glob(f"{segment_prefix(run_id)}e1t0_4*"))
    finally:
        sweep_run(run_id)


def test_sweep_run_removes_only_that_run():
    a, b = f"a{time.monotonic_ns()}", f"b{time.monotonic_ns()}"
    for run in (a, b):
        (SHM_DIR / f"{segment_prefix(run)}x_0").write_bytes(b"x")
    assert sweep_run(a) == 1
    assert (SHM_DIR / f"{segment_prefix(b)}x_0").exists()
    sweep_run(b)


def _dist_runtime(port: int):
    """The runtime of a DistChannel end, reduced to what it uses."""
    from types import SimpleNamespace

    return SimpleNamespace(
        store=_store(port, False), device=torch.device("cpu"),
        watchdog=SimpleNamespace(check=lambda: None), prefix="t",
        env=SimpleNamespace(master_addr="127.0.0.1", master_port=port),
        cfg=SimpleNamespace(sync=SimpleNamespace(dead_peer_s=5.0, timeout_s=60.0)))


def _dist_end(port: int, side: str, n: int, q):
    """One end of a DistChannel over a real gloo pair."""
    from llamarl.buffer.dist_channel import DistChannel

    ch = DistChannel(_dist_runtime(port), "e0t0", side, capacity=2)
    if side == "producer":
        for i in range(n):
            assert ch.put(make_batch(3, 2, seed=10 + i, version=i))
        q.put(("closed", ch.close(drain_timeout_s=60)))
    else:
        for i in range(n):
            b = ch.get()
            q.put(("got", i, same(b, make_batch(3, 2, seed=10 + i, version=i)), b.info))


def test_dist_channel_moves_batches_over_gloo_between_processes():
    server = _store(0, True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_dist_end, args=(server.port, side, 4, q))
             for side in ("producer", "consumer")]
    for p in procs:
        p.start()
    try:
        events = [q.get(timeout=120) for _ in range(5)]
        got = sorted((e for e in events if e[0] == "got"), key=lambda e: e[1])
        assert [e[2] for e in got] == [True] * 4
        assert [e[3] for e in got] == [{"seed": 10 + i} for i in range(4)]
        assert ("closed", 0) in events  # all consumed: nothing left to release
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            p.kill()


def _lost_producer(port: int, q):
    """Sends batch 0, then publishes batch 1's descriptor without its payload and dies, as a
    producer killed between the two."""
    import os
    import queue

    from llamarl.buffer.dist_channel import DistChannel

    ch = DistChannel(_dist_runtime(port), "e0t0", "producer", capacity=2)
    assert ch.put(make_batch(3, 2, seed=10, version=0))
    q.get(timeout=120)  # the consumer has batch 0
    ch._outbox = queue.Queue()  # (its send thread waits on the old queue: 1 is never sent)
    assert ch.put(make_batch(3, 2, seed=11, version=1))
    os._exit(0)


def _taking_producer(port: int):
    """Takes the channel over (dist_channel.py) and makes batch 1 again."""
    from llamarl.buffer.dist_channel import DistChannel

    ch = DistChannel(_dist_runtime(port), "e0t0", "producer", capacity=2, takeover="r1")
    deadline = time.monotonic() + 60
    while ch.adopt() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert ch._seq == 1
    assert ch.put(make_batch(3, 2, seed=11, version=1))
    assert ch.close(drain_timeout_s=60) == 0


def _following_consumer(port: int, lost, produced, q):
    from llamarl.buffer.dist_channel import DistChannel

    ch = DistChannel(_dist_runtime(port), "e0t0", "consumer", capacity=2, follow=True)
    q.put(same(ch.get(), make_batch(3, 2, seed=10, version=0)))
    produced.put("got 0")
    lost.wait(120)  # batch 1's descriptor is queued and its producer dead: the receive
    q.put(same(ch.get(), make_batch(3, 2, seed=11, version=1)))  # fails to post, then follows


def test_dist_channel_follows_a_takeover_when_its_producer_died_before_the_receive():
    """A producer that dies with a descriptor queued and its payload unsent: gloo refuses even
    to post the receive (the peer closed its connection). The consumer must treat that as the
    loss it is, and receive the batch again from the producer that takes the channel over."""
    server = _store(0, True)
    ctx = mp.get_context("spawn")
    q, produced, lost = ctx.Queue(), ctx.Queue(), ctx.Event()
    first = ctx.Process(target=_lost_producer, args=(server.port, produced))
    consumer = ctx.Process(target=_following_consumer, args=(server.port, lost, produced, q))
    taker = ctx.Process(target=_taking_producer, args=(server.port,))
    procs = [first, consumer, taker]
    for p in procs[:2]:
        p.start()
    try:
        assert q.get(timeout=120) is True
        first.join(60)
        assert first.exitcode == 0
        lost.set()
        time.sleep(1.0)  # the consumer has tried the dead pair by now
        taker.start()
        assert q.get(timeout=120) is True
        for p in (consumer, taker):
            p.join(60)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.pid is not None:
                p.kill()
