"""parallel/shares.py: which engine makes and which trainer rank trains each prompt group of a
step, by hand-computed ranges."""

from __future__ import annotations

import pytest
from test_buffer import make_batch

from llamarl.buffer.record import split_counts
from llamarl.config import load_config
from llamarl.parallel.shares import PromptShares, Route


def test_equal_shares_one_channel_each():
    """P = 8, E = 2, T = 2: engine 0 makes groups 0-3 = trainer 0's, engine 1 4-7."""
    s = PromptShares(8, 2, 2)
    assert [s.engine_range(e) for e in range(2)] == [(0, 4), (4, 8)]
    assert [s.trainer_range(r) for r in range(2)] == [(0, 4), (4, 8)]
    assert s.routes_of_engine(0) == [Route(0, 0, 4)]
    assert s.routes_of_engine(1) == [Route(1, 0, 4)]
    assert [s.engines_of_trainer(r) for r in range(2)] == [[0], [1]]


def test_more_trainers_than_engines():
    """P = 6, E = 2, T = 3: engine 0 makes [0, 3): trainer 0's [0, 2) and the first group of
    trainer 1's [2, 4); engine 1 makes [3, 6): the second of trainer 1's and trainer 2's."""
    s = PromptShares(6, 2, 3)
    assert s.routes_of_engine(0) == [Route(0, 0, 2), Route(1, 2, 1)]
    assert s.routes_of_engine(1) == [Route(1, 0, 1), Route(2, 1, 2)]
    assert [s.engines_of_trainer(r) for r in range(3)] == [[0], [0, 1], [1]]


def test_unequal_engine_shares():
    """P = 4, E = 3, T = 2: engines make floor(e P / E) ranges [0, 1), [1, 2), [2, 4) (sizes
    1, 1, 2; the largest, ceil(4 / 3) = 2, numbers group ids)."""
    s = PromptShares(4, 3, 2)
    assert [s.groups_of_engine(e) for e in range(3)] == [1, 1, 2]
    assert s.most_of_an_engine == 2
    assert [s.routes_of_engine(e) for e in range(3)] == [
        [Route(0, 0, 1)], [Route(0, 0, 1)], [Route(1, 0, 2)]]


@pytest.mark.parametrize("T, E", [(8, 8), (32, 32), (256, 768), (256, 96), (3, 7), (7, 3)])
def test_every_group_made_once_and_trained_once(T, E):
    """Each trainer rank gets P / T groups, each engine's routes cover its share exactly once,
    and channels per rank stay within ceil(T / E) + 1 and ceil(E / T) + 1."""
    P = -(-max(E, T) // T) * T  # the smallest the config accepts
    s = PromptShares(P, E, T)
    got = [0] * T
    for e in range(E):
        routes = s.routes_of_engine(e)
        assert sum(r.count for r in routes) == s.groups_of_engine(e)
        assert [r.first for r in routes] == [sum(x.count for x in routes[:i])
                                             for i in range(len(routes))]
        assert len(routes) <= -(-T // E) + 1
        for r in routes:
            got[r.trainer] += r.count
    assert got == [P // T] * T
    assert max(len(s.engines_of_trainer(r)) for r in range(T)) <= -(-E // T) + 1


def test_split_counts_cuts_whole_groups_in_order():
    """A batch of 4 groups of 3 samples split into runs of 1 and 3 groups."""
    batch = make_batch(4, 3, seed=1)
    first, rest = split_counts(batch, [1, 3])
    assert len(first) == 3 and len(rest) == 9
    assert first.group_ids.unique().tolist() == batch.group_ids[:3].unique().tolist()
    with pytest.raises(ValueError, match="do not split"):
        split_counts(batch, [1, 2])


def test_prompts_per_step_a_multiple_of_the_trainer_ranks_only():
    """E = 3, T = 2: 4 prompts a step is accepted (was: a multiple of 6); 3 is not (T = 2), and
    2 is too few for 3 engines."""
    base = ["trainer.ranks=2", "generator.engines=3"]
    load_config("recipes/tiny_grpo_cpu.yaml", [*base, "generator.prompts_per_step=4"])
    with pytest.raises(ValueError, match="multiple of trainer.ranks = 2"):
        load_config("recipes/tiny_grpo_cpu.yaml", [*base, "generator.prompts_per_step=3"])
    with pytest.raises(ValueError, match="at least generator.engines = 3"):
        load_config("recipes/tiny_grpo_cpu.yaml", [*base, "generator.prompts_per_step=2"])
