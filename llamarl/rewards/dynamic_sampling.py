"""DAPO's dynamic sampling (Yu et al. 2025): train only on prompt groups whose rewards differ.

A group whose G rewards are all equal has zero advantage under every group baseline (GRPO, RLOO,
...), so it adds no gradient and only dilutes the batch. With dynamic sampling a generator keeps
drawing new prompts until it holds `want` informative groups:

    kept, dropped = [], []
    for round in 1 .. max_rounds:
        draw (want - len(kept)) prompts, generate G samples each, score them
        kept += groups with max(r) - min(r) > tol;  dropped += the others
        stop once len(kept) == want
    fill the remaining (want - len(kept)) slots with the most recent dropped groups

Only the missing number of prompts is drawn each round, so no informative group is thrown away.
The fill after `max_rounds` keeps a hard task (or a collapsed policy) from looping forever; it is
counted (`ds_filled_groups`) so a run that fills often is visible in metrics.jsonl.
Without dynamic sampling the loop runs one round and keeps everything.
"""

from __future__ import annotations

from collections.abc import Callable

from llamarl.algorithms.advantages import EQUAL_REWARDS_TOL
from llamarl.rewards.scorer import ScoredGroup

# reward spread up to this counts as "all equal" (float noise): such a group's advantages are 0
INFORMATIVE_TOL = EQUAL_REWARDS_TOL


def is_informative(rewards: list[float], tol: float = INFORMATIVE_TOL) -> bool:
    return max(rewards) - min(rewards) > tol


def collect_groups(draw: Callable[[int], list], sample: Callable[[list, int, int], list],
                   want: int, dynamic: bool, max_rounds: int) -> tuple[list[ScoredGroup], dict]:
    """`want` scored groups and counts for metrics.

    draw(n) -> n prompts; sample(prompts, round, first_index) -> their ScoredGroups (indices
    first_index, first_index + 1, ...). Returns the groups in the order they were drawn, and
    {ds_rounds, ds_dropped_groups (generated, not used), ds_filled_groups (uninformative, used
    to fill)}.
    """
    assert want > 0 and max_rounds >= 1
    kept: list[ScoredGroup] = []
    dropped: list[ScoredGroup] = []
    rounds = drawn = 0
    while len(kept) < want and rounds < (max_rounds if dynamic else 1):
        prompts = draw(want - len(kept))
        groups = sample(prompts, rounds, drawn)
        assert len(groups) == len(prompts), (len(groups), len(prompts))
        drawn += len(prompts)
        rounds += 1
        for g in groups:
            (kept if not dynamic or is_informative(g.rewards) else dropped).append(g)
    filled = want - len(kept)
    if filled:
        kept += dropped[len(dropped) - filled:]
    kept.sort(key=lambda g: g.index)
    return kept, {"ds_rounds": rounds, "ds_dropped_groups": len(dropped) - filled,
                  "ds_filled_groups": filled}
