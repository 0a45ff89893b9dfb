"""The prompt loader of one generator engine: its shard of the training prompts, endlessly, in a
shuffled order per epoch, with a state that can be saved after any draw and restored.

Shard of engine e out of E: prompts[e::E] (disjoint, and together they cover every prompt).
Order: epoch t of a shard of n prompts visits the permutation

    random.Random(f"{seed}:{t}").shuffle(list(range(n)))

so the order is a pure function of (seed, shard) and does not depend on how many prompts each
batch draws. Built on torchdata.nodes: an endless `EpochShuffle` index node, mapped to prompts,
under a `Loader`; `state_dict()` is a small JSON-able dict (epoch, position, shard identity)
that travels with each rollout batch to the trainer and into its checkpoint.
"""

from __future__ import annotations

import random
from typing import Any

from torchdata.nodes import BaseNode, Loader, Mapper


def shard(items: list, index: int, count: int) -> list:
    """Engine `index`'s share of `items` when there are `count` engines."""
    part = items[index::count]
    if not part:
        raise ValueError(f"engine {index} got no prompts: the dataset has {len(items)} training "
                         f"prompts for {count} engines; use fewer generator.engines or more data")
    return part


class EpochShuffle(BaseNode[int]):
    """Endless indices into n items: each epoch a new seeded permutation of range(n).
    State: {"epoch": t, "index": position within epoch t's permutation}."""

    def __init__(self, n: int, seed: int):
        super().__init__()
        assert n > 0, n
        self.n, self.seed = n, seed
        self.epoch = self.index = 0
        self._order: list[int] = []

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def reset(self, initial_state: dict[str, Any] | None = None):
        super().reset(initial_state)
        state = initial_state or {"epoch": 0, "index": 0}
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)

    def next(self) -> int:
        if self.index == self.n:
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        i = self._order[self.index]
        self.index += 1
        return i

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index}


class PromptLoader:
    """next(k) draws k prompts of this engine's shard; state_dict() after any draw restores the
    exact continuation with load_state_dict()."""

    def __init__(self, prompts: list, seed: int, shard_index: int = 0, shards: int = 1):
        self.prompts = prompts
        self.identity = {"shard": shard_index, "shards": shards, "size": len(prompts)}
        self._indices = EpochShuffle(len(prompts), seed)
        self.loader = Loader(Mapper(self._indices, prompts.__getitem__),
                             restart_on_stop_iteration=False)  # the index node never ends
        self._it = iter(self.loader)

    def next(self, k: int) -> list:
        return [next(self._it) for _ in range(k)]

    @property
    def epoch(self) -> int:
        """Passes completed over this shard so far (0 during the first)."""
        return self._indices.epoch

    def state_dict(self) -> dict[str, Any]:
        return {**self.identity, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = {k: state.get(k) for k in self.identity}
        if saved != self.identity:
            raise ValueError(f"the checkpoint's data position is for prompt shard {saved}, but "
                             f"this run has {self.identity}: resume with the same data.* keys, "
                             "run.seed and generator.engines")
        self.loader.load_state_dict(state["loader"])
        self._it = iter(self.loader)
