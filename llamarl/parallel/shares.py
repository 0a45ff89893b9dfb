"""Who makes and who trains each prompt group of a step: a pure function of
(prompts_per_step P, engines E, trainer ranks T), in the style of runtime/layout.py.

A step's P prompt groups are numbered 0 .. P-1 in one global order. Engine e (slot e,
runtime/roster.py) makes the contiguous range

    engine_range(e) = [floor(e P / E), floor((e + 1) P / E))     (sizes differ by at most one)

and trainer rank r trains the contiguous range

    trainer_range(r) = [r P / T, (r + 1) P / T)                  (P a multiple of T: FSDP2
                                                                  ranks step in lockstep on
                                                                  equal shares)

so engine e sends trainer r the groups of the intersection, in order, and nothing when it is
empty. A rollout channel (engine e -> trainer r) exists only for a non-empty intersection:

    channels of an engine   <= ceil(T / E) + 1      (1-2 when E >= T)
    channels of a trainer   <= ceil(E / T) + 1      (1-2 when T >= E)

instead of every engine with every trainer rank (E x T channels, and P a multiple of E x T:
196,608 prompts a step at 1024 GPUs). What a step trains is the same set of groups; which rank
trains which group changes, so with E, T > 1 the float sums of the update round differently
from the old interleaved split (docs/scaling.md).

Requirements (config.py checks them with the fix): P % T == 0 and P >= E (every engine makes
at least one group).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Route:
    """Groups [first, first + count) of an engine's batch (its own order) go to `trainer`."""

    trainer: int
    first: int
    count: int


@dataclass(frozen=True)
class PromptShares:
    prompts: int  # P: prompt groups a step, across all engines
    engines: int  # E
    trainers: int  # T

    def __post_init__(self):
        assert self.prompts % self.trainers == 0 and self.prompts >= self.engines >= 1, self

    # -- ranges in the step's global order ----------------------------------------------
    def engine_range(self, e: int) -> tuple[int, int]:
        P, E = self.prompts, self.engines
        return e * P // E, (e + 1) * P // E

    def trainer_range(self, r: int) -> tuple[int, int]:
        per = self.prompts // self.trainers
        return r * per, (r + 1) * per

    def groups_of_engine(self, e: int) -> int:
        """Prompt groups engine (slot) e makes a step."""
        lo, hi = self.engine_range(e)
        return hi - lo

    @property
    def most_of_an_engine(self) -> int:
        """The largest engine share, ceil(P / E): what sizes an engine's calls and the stride
        of its group ids (generator/loop.py)."""
        return -(-self.prompts // self.engines)

    # -- who talks to whom ----------------------------------------------------------------
    def routes_of_engine(self, e: int) -> list[Route]:
        """Where engine e's batch goes, trainer order: each route a contiguous run of its
        groups; the counts sum to groups_of_engine(e)."""
        return self._routes[e]

    def engines_of_trainer(self, r: int) -> list[int]:
        """The engines trainer rank r reads from, in engine order (its groups come in that
        order: engine by engine, each engine's in its own order)."""
        return [e for e in range(self.engines)
                if any(route.trainer == r for route in self._routes[e])]

    def linked(self, e: int, r: int) -> bool:
        """Whether engine e sends trainer rank r anything (a channel between them)."""
        return any(route.trainer == r for route in self._routes[e])

    @cached_property
    def _routes(self) -> list[list[Route]]:
        per = self.prompts // self.trainers
        out = []
        for e in range(self.engines):
            lo, hi = self.engine_range(e)
            routes = []
            for r in range(lo // per, -(-hi // per)):  # trainers whose range meets [lo, hi)
                a, b = max(lo, r * per), min(hi, (r + 1) * per)
                if b > a:
                    routes.append(Route(r, a - lo, b - a))
            out.append(routes)
        return out


def prompt_shares(cfg, engines: int | None = None, trainers: int | None = None) -> PromptShares:
    """The shares of a recipe (a Config); `engines` / `trainers` default to its layout's."""
    return PromptShares(cfg.generator.prompts_per_step,
                        cfg.generator.engines if engines is None else engines,
                        cfg.trainer.ranks if trainers is None else trainers)
