"""parallel/weight_gather.py: the one-sender gather's layout and unpacking, by hand-computed
values (the gather itself simulated by concatenating each rank's padded flat, as
all_gather_single lays them out), and its resharded units' order."""

from __future__ import annotations

import torch

from llamarl.parallel.weight_gather import (
    OneSender,
    Unit,
    gather_plan,
    padded_input,
    shard_rows,
    unpack,
)
from llamarl.parallel.weight_plan import Bucket, TensorMeta, plan_buckets

CPU = torch.device("cpu")


def _gather(plan, pieces_by_rank, world):
    """What every rank holds after all_gather_single: rank r's padded flat at [r P, (r+1) P)."""
    return torch.cat([padded_input(plan, pieces_by_rank[r], r, world, CPU)
                      for r in range(world)])


def test_shard_rows_follow_torch_chunk():
    # 7 rows over 3 ranks: chunks of 3 -> 3, 3, 1; 2 rows over 3: 1, 1, 0; 5 over 4: 2, 2, 1, 0
    assert [shard_rows(7, 3, r) for r in range(3)] == [(0, 3), (3, 3), (6, 1)]
    assert [shard_rows(2, 3, r) for r in range(3)] == [(0, 1), (1, 1), (2, 0)]
    assert [shard_rows(5, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 1), (5, 0)]
    for rows, world in ((7, 3), (2, 3), (5, 4), (8, 2)):
        assert [n for _, n in (shard_rows(rows, world, r) for r in range(world))] == [
            len(c) for c in torch.arange(rows).chunk(world)] + [0] * (
                world - len(torch.arange(rows).chunk(world)))


def test_uneven_rows_fewer_rows_than_ranks_and_a_replicated_tensor():
    """T = 3. a: [7, 2] sharded (3, 3, 1 rows); b: [2] sharded (1, 1, 0); c: [3] replicated
    (trainer 0's whole). Padded flat per rank: a's chunk 3 x 2 = 6 elements at 0, b's 1 x 1 at
    6: P = 7; c is not gathered."""
    a = torch.arange(14, dtype=torch.float32).view(7, 2)
    b = torch.tensor([100.0, 101.0])
    c = torch.tensor([7.0, 8.0, 9.0])
    metas = [TensorMeta("a", "torch.float32", (7, 2)), TensorMeta("b", "torch.float32", (2,)),
             TensorMeta("c", "torch.float32", (3,))]
    bucket, = plan_buckets(metas, 1 << 20, 1 << 20)
    assert [off for _, off in bucket.entries] == [0, 14, 16] and bucket.numel == 19
    plan = gather_plan(bucket, {"a", "b"}, 3)
    assert plan.padded == 7 and not plan.alone
    assert [(e.chunk, e.inner, e.padded_offset) for e in plan.entries] == [
        (3, 2, 0), (1, 1, 6), (0, 0, 7)]
    pieces = [{"a": a[0:3], "b": b[0:1]}, {"a": a[3:6], "b": b[1:2]},
              {"a": a[6:7], "b": b[2:2]}]
    gathered = _gather(plan, pieces, 3)
    assert gathered.shape == (21,)
    # rank 2's flat: a's row 6 (12, 13), then padding, then no row of b
    assert gathered[14:16].tolist() == [12.0, 13.0]
    flat = unpack(plan, gathered, {"c": c}, 3, CPU)
    assert flat.tolist() == list(range(14)) + [100.0, 101.0, 7.0, 8.0, 9.0]


def test_a_bucket_of_one_sharded_tensor_is_the_gathered_flat():
    """[5, 3] over 2 ranks (3 + 2 rows): P = 9; the gathered [18] holds rank 0's 3 rows,
    then rank 1's 2 and 3 elements of padding: its first 15 elements are the tensor."""
    t = torch.arange(15, dtype=torch.float32).view(5, 3)
    bucket = Bucket("torch.float32", ((TensorMeta("w", "torch.float32", (5, 3)), 0),), 15)
    plan = gather_plan(bucket, {"w"}, 2)
    assert plan.alone and plan.padded == 9
    # rank 0's shard fills its chunk and is in the wire dtype: contributed as it is
    shard0 = t[0:3].clone()
    assert padded_input(plan, {"w": shard0}, 0, 2, CPU).data_ptr() == shard0.data_ptr()
    gathered = _gather(plan, [{"w": t[0:3].clone()}, {"w": t[3:5].clone()}], 2)
    flat = unpack(plan, gathered, {}, 2, CPU)
    assert flat.data_ptr() == gathered.data_ptr() and flat.tolist() == list(range(15))


def test_gathered_in_the_wire_dtype():
    """Float32 shards of a bfloat16 bucket are cast when packed: the gather moves half."""
    t = torch.tensor([[1.5, 2.25], [3.0, -4.0]])
    metas = [TensorMeta("w", "torch.bfloat16", (2, 2)), TensorMeta("n", "torch.bfloat16", (1,))]
    bucket, = plan_buckets(metas, 1 << 20, 1 << 20)
    plan = gather_plan(bucket, {"w"}, 2)
    gathered = _gather(plan, [{"w": t[0:1]}, {"w": t[1:2]}], 2)
    assert gathered.dtype == torch.bfloat16
    flat = unpack(plan, gathered, {"n": torch.tensor([0.5])}, 2, CPU)
    assert flat.dtype == torch.bfloat16
    assert flat.tolist() == [1.5, 2.25, 3.0, -4.0, 0.5]


def test_resharded_units_keep_the_window_of_full_buckets_they_read():
    """Units sorted by the last full bucket they read; the window kept from the smallest
    first bucket of the units left (a later unit may read an earlier bucket)."""
    b = Bucket("torch.float32", (), 1)
    units = [Unit(0, 0, b, 0, 1, True), Unit(1, 0, b, 0, 0, True), Unit(1, 1, b, 1, 2, True),
             Unit(0, 1, b, 2, 2, True)]
    units.sort(key=lambda u: u.last)
    assert [(u.to, u.tag) for u in units] == [(1, 0), (0, 0), (1, 1), (0, 1)]
    assert OneSender._keep_from(units) == [0, 0, 1, 2]
