"""parallel/plan.py: the job's groups, by hand-counted layouts (no process is started)."""

from __future__ import annotations

import pytest

from llamarl.config import load_config
from llamarl.parallel.plan import comm_plan
from llamarl.runtime.layout import compute_layout


def _cfg(*overrides):
    return load_config("recipes/tiny_grpo_cpu.yaml", ["generator.prompts_per_step=64",
                                                      *overrides])


def test_shared_weight_groups_one_per_trainer_rank():
    """2 trainer ranks (0, 1) + 2 engines of tp 1 (ranks 2, 3), one node, gloo: wsync0 =
    [0, 2, 3], wsync1 = [1, 2, 3]; each engine receives on both, in trainer order; rollouts go
    through shared memory (no group)."""
    layout = compute_layout(4, 4, 2, 2, 1)
    plan = comm_plan(_cfg("trainer.ranks=2", "generator.engines=2"), layout, "gloo")
    assert not plan.weight_pairs and not plan.reshard_groups
    assert [(g.name, g.ranks) for g in plan.weight_groups(0)] == [("wsync0", (0, 2, 3))]
    assert [(g.name, g.ranks) for g in plan.weight_groups(1)] == [("wsync1", (1, 2, 3))]
    assert [g.name for g in plan.receiver_groups(3)] == ["wsync0", "wsync1"]
    assert plan.receiver_groups(3)[0].rank_of(3) == 2
    assert plan.rollout_group(0, 0) is None
    assert [g.name for g in plan.groups_of(0)] == ["wsync0"]
    assert [g.name for g in plan.groups_of(2)] == ["wsync0", "wsync1"]
    assert plan.survives_engine_loss  # gloo sends point to point


def test_pair_groups_on_nccl_when_engines_can_be_lost():
    """sync.weight_groups auto on NCCL, engine_loss continue, one node: one group per
    (trainer, engine), [trainer r, engine e's tp ranks]; an engine rank is in one per trainer
    rank; a lost engine's pairs can be aborted, so the job survives."""
    layout = compute_layout(6, 6, 2, 2, 2)  # trainers 0-1, engine 0 = 2-3, engine 1 = 4-5
    plan = comm_plan(_cfg("trainer.ranks=2", "generator.engines=2", "generator.tp=2",
                          "sync.senders=every"), layout, "nccl")
    assert plan.weight_pairs and plan.survives_engine_loss and plan.senders == 2
    assert [(g.name, g.ranks) for g in plan.weight_groups(1)] == [
        ("wsync1/pair0", (1, 2, 3)), ("wsync1/pair1", (1, 4, 5))]
    assert [g.name for g in plan.receiver_groups(5)] == ["wsync0/pair1", "wsync1/pair1"]
    assert plan.receiver_groups(5)[0].rank_of(5) == 2
    assert plan.reshard_groups_of(0) == []  # pairs send point to point
    # engine 1's leader: 2 pair groups + its command group
    assert [g.name for g in plan.groups_of(4)] == ["wsync0/pair1", "wsync1/pair1",
                                                   "engine1/commands"]
    assert plan.command_group(1, "ab12").name == "engine1.ab12/commands"


def test_reshard_groups_on_broadcasts_with_shared_groups():
    """NCCL, shared groups (engine_loss stop), tp 2: trainer r broadcasts tp rank k's blocks
    on wsync<r>t<k> = [r, tp rank k of every engine]: 2 per trainer rank, and each engine
    rank is in one per trainer rank."""
    layout = compute_layout(6, 6, 2, 2, 2)
    plan = comm_plan(_cfg("trainer.ranks=2", "generator.engines=2", "generator.tp=2",
                          "sync.engine_loss=stop", "sync.senders=every"), layout, "nccl")
    assert not plan.weight_pairs and plan.reshard_groups and not plan.survives_engine_loss
    assert [(g.name, g.ranks) for g in plan.reshard_groups_of(0)] == [
        ("wsync0t0", (0, 2, 4)), ("wsync0t1", (0, 3, 5))]
    assert [(g.name, g.ranks) for g in plan.reshard_groups_of(5)] == [
        ("wsync0t1", (0, 3, 5)), ("wsync1t1", (1, 3, 5))]


def test_rollout_pair_groups_across_nodes():
    """Two nodes of 2 ranks: trainers 0-1 on node 0, engines (ranks 2, 3) on node 1: every
    channel crosses nodes and takes a pair group [engine leader, trainer]. With 64 prompt
    groups a step, engine 0 makes groups 0-31, which trainer 0 trains, engine 1 32-63,
    trainer 1's: one channel each (parallel/shares.py), not 2 x 2."""
    layout = compute_layout(4, 2, 2, 2, 1)
    plan = comm_plan(_cfg("trainer.ranks=2", "generator.engines=2"), layout, "gloo")
    group = plan.rollout_group(1, 1)
    assert (group.name, group.ranks, group.purpose) == ("xfer/e1t1", (3, 1), "rollouts")
    assert [g.name for g in plan.groups_of(3)] == ["wsync0", "wsync1", "xfer/e1t1"]
    assert [g.name for g in plan.groups_of(0)] == ["wsync0", "xfer/e0t0"]
    with pytest.raises(AssertionError):  # no channel: engine 1 sends trainer 0 nothing
        plan.rollout_group(1, 0)


def test_rollout_channels_follow_the_shares():
    """3 engines, 2 trainer ranks, 4 groups a step, every rank its own node: engines make
    [0, 1), [1, 2), [2, 4); trainers train [0, 2), [2, 4): engines 0 and 1 send trainer 0,
    engine 2 trainer 1."""
    layout = compute_layout(5, 1, 2, 3, 1)
    plan = comm_plan(_cfg("trainer.ranks=2", "generator.engines=3",
                          "generator.prompts_per_step=4"), layout, "gloo")
    assert [plan.rollout_trainers(e) for e in range(3)] == [[0], [0], [1]]
    assert [plan.rollout_engines(r) for r in range(2)] == [[0, 1], [2]]
    assert [g.name for g in plan.groups_of(0) if g.purpose == "rollouts"] == [
        "xfer/e0t0", "xfer/e1t0"]
    assert [g.name for g in plan.groups_of(4) if g.purpose == "rollouts"] == ["xfer/e2t1"]


@pytest.mark.parametrize("backend,senders", [("gloo", "auto"), ("nccl", "every"),
                                             ("nccl", "one"), ("gloo", "one")])
def test_every_group_a_rank_counts_has_it_as_a_member(backend, senders):
    layout = compute_layout(12, 6, 4, 4, 2)
    plan = comm_plan(_cfg("trainer.ranks=4", "generator.engines=4", "generator.tp=2",
                          "sync.engine_loss=stop", f"sync.senders={senders}"), layout, backend)
    for rank in range(layout.world_size):
        for group in plan.groups_of(rank):
            assert rank in group.ranks, (rank, group)


def test_one_sender_shared_groups_and_resharding():
    """sync.senders one, NCCL, shared groups (engine_loss stop), 3 trainer ranks (0-2), 2
    engines of tp 2 (3-4, 5-6): trainer 0 alone sends, on wsync0 and wsync0t<k>; trainers 1
    and 2 are in no weight group; an engine GPU is in 1 weight + 1 resharding group (every:
    3 + 3)."""
    layout = compute_layout(7, 7, 3, 2, 2)
    cfg = ["trainer.ranks=3", "generator.engines=2", "generator.tp=2", "sync.engine_loss=stop",
           "generator.prompts_per_step=72"]
    plan = comm_plan(_cfg(*cfg, "sync.senders=one"), layout, "nccl")
    assert plan.one_sender and plan.senders == 1 and plan.reshard_groups
    assert [(g.name, g.ranks) for g in plan.weight_groups(0)] == [("wsync0", (0, 3, 4, 5, 6))]
    assert plan.weight_groups(1) == plan.weight_groups(2) == []
    assert [g.name for g in plan.groups_of(0)] == ["wsync0", "wsync0t0", "wsync0t1"]
    assert plan.groups_of(2) == []
    assert [(g.name, g.ranks) for g in plan.groups_of(6)] == [
        ("wsync0", (0, 3, 4, 5, 6)), ("engine1/commands", [5, 6]), ("wsync0t1", (0, 4, 6))]
    every = comm_plan(_cfg(*cfg, "sync.senders=every"), layout, "nccl")
    assert [g.purpose for g in every.groups_of(6)].count("weights") == 3
    assert [g.purpose for g in every.groups_of(6)].count("reshard") == 3
    # auto: one on NCCL, every on gloo
    assert comm_plan(_cfg(*cfg), layout, "nccl").one_sender
    assert not comm_plan(_cfg(*cfg), layout, "gloo").one_sender


def test_one_sender_pair_groups():
    """sync.senders auto on NCCL with engines that can be lost: trainer 0's pair groups
    alone, wsync0/pair<e>; engine 1's ranks receive on wsync0/pair1 only."""
    layout = compute_layout(6, 6, 2, 2, 2)
    plan = comm_plan(_cfg("trainer.ranks=2", "generator.engines=2", "generator.tp=2"),
                     layout, "nccl")
    assert plan.weight_pairs and plan.one_sender and plan.survives_engine_loss
    assert [(g.name, g.ranks) for g in plan.weight_groups(0)] == [
        ("wsync0/pair0", (0, 2, 3)), ("wsync0/pair1", (0, 4, 5))]
    assert plan.weight_groups(1) == []
    assert [g.name for g in plan.groups_of(5)] == ["wsync0/pair1", "engine1/commands"]


def test_one_trainer_rank_or_another_transport_sends_as_every():
    layout = compute_layout(3, 3, 1, 2, 1)
    assert not comm_plan(_cfg("generator.engines=2", "sync.senders=one"), layout,
                         "nccl").one_sender  # one trainer rank: it is the one sender
    with pytest.raises(ValueError, match="sync.senders"):
        _cfg("sync.senders=one", "sync.transport=filesystem")
    with pytest.raises(ValueError, match="sync.senders"):
        _cfg("sync.senders=all")
