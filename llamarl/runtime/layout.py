"""The rank layout: which global rank plays which role. A pure function, unit-tested.
The whole picture (layout, process groups, one rollout, one weight update):
docs/architecture.md.

    world ranks:  [ trainer 0 .. T-1 | engine 0 (tp ranks) | engine 1 (tp ranks) | ... ]

Trainer ranks come first so that global rank 0 is always trainer 0 (it writes the run directory
and sends the weights). Each engine's tp ranks must sit on one node: tensor parallelism inside a
vLLM engine talks over the node's fast links.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankRole:
    rank: int
    role: str  # "trainer" | "generator"
    index: int  # trainer rank within the trainer sub-mesh, or engine index
    tp_rank: int = 0  # rank inside the engine (generators only)

    @property
    def name(self) -> str:
        if self.role == "trainer":
            return f"trainer {self.index}"
        return f"generator {self.index}" + (f" (tp rank {self.tp_rank})" if self.tp_rank else "")

    @property
    def is_engine_leader(self) -> bool:
        return self.role == "generator" and self.tp_rank == 0


@dataclass(frozen=True)
class Layout:
    world_size: int
    ranks_per_node: int
    trainer_ranks: int
    engines: int
    tp: int

    def role_of(self, rank: int) -> RankRole:
        assert 0 <= rank < self.world_size, (rank, self.world_size)
        if rank < self.trainer_ranks:
            return RankRole(rank, "trainer", rank)
        g = rank - self.trainer_ranks
        return RankRole(rank, "generator", g // self.tp, g % self.tp)

    @property
    def trainer_global_ranks(self) -> list[int]:
        return list(range(self.trainer_ranks))

    def engine_global_ranks(self, engine: int) -> list[int]:
        start = self.trainer_ranks + engine * self.tp
        return list(range(start, start + self.tp))

    @property
    def generator_global_ranks(self) -> list[int]:
        return list(range(self.trainer_ranks, self.world_size))

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def describe(self) -> str:
        return (f"{self.world_size} ranks = {self.trainer_ranks} trainer + {self.engines} engine(s)"
                f" x tp {self.tp}")


def compute_layout(world_size: int, ranks_per_node: int, trainer_ranks: int, engines: int,
                   tp: int) -> Layout:
    """Validate and build the layout; a mismatch is a one-line ValueError naming the numbers."""
    for name, value in (("trainer.ranks", trainer_ranks), ("generator.engines", engines),
                        ("generator.tp", tp)):
        if value < 1:
            raise ValueError(f"{name} = {value}: must be at least 1")
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"world size {world_size} is not a whole number of nodes of "
                         f"{ranks_per_node} ranks: launch the same --nproc-per-node on every node")
    needed = trainer_ranks + engines * tp
    if world_size != needed:
        raise ValueError(
            f"world size {world_size} does not fit the recipe: trainer.ranks {trainer_ranks} + "
            f"generator.engines {engines} x generator.tp {tp} = {needed}; launch {needed} ranks "
            f"(torchrun --nproc-per-node {needed}) or change the recipe")
    layout = Layout(world_size, ranks_per_node, trainer_ranks, engines, tp)
    for e in range(engines):
        ranks = layout.engine_global_ranks(e)
        if layout.node_of(ranks[0]) != layout.node_of(ranks[-1]):
            raise ValueError(
                f"engine {e} (ranks {ranks[0]}-{ranks[-1]}) straddles two nodes of "
                f"{ranks_per_node} ranks: choose trainer.ranks and generator.tp so that each "
                "engine's tp ranks fit on one node")
    return layout
