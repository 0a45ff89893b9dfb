"""The job's communication plan: every process group built on the job store, named and sized
by one pure function of the recipe, the layout and the backend (no process is started, no
store is touched), in the style of runtime/layout.py.

    purpose    name                       members (global ranks)                   when
    weights    wsync<r>                   trainer r, every generator rank          shared groups
               wsync<r>/pair<e>           trainer r, engine e's tp ranks           pair groups
                                          (r = 0 alone under sync.senders one)
    reshard    wsync<r>t<k>               trainer r, tp rank k of every engine     tp > 1, resharded
                                                                                   syncs, broadcasts
    rollouts   xfer/e<e>t<r>              engine e's leader, trainer r             different nodes,
                                                                                   e sends r groups
    commands   engine<e>/commands         engine e's tp ranks                      tp > 1
    join       wsync<r>/join<e>.<n>       trainer r, replacement n of engine e     a --join (named
                                                                                   here, made later)

Rollout pair groups and an engine's command stream are gloo groups on every job, GPU jobs
included (host memory to host memory: buffer/dist_channel.py, generator/tp.py say why): no NCCL
communicator, so `gpu_communicators` leaves them out.

Group rank i is member i of `ranks`. Engine e sends trainer rank r rollouts only when their
shares of the step's prompt groups meet (parallel/shares.py: a channel for each, 1-2 per engine
when E >= T). A rollout channel between ranks of one node goes through shared memory
(buffer/shm.py) and needs no group. Shared or pair weight groups: sync.
weight_groups (auto picks pairs on NCCL when the job survives engine losses on one node, so a
lost engine's groups can be aborted and the others go on).

Who sends (sync.senders, `one_sender`): every trainer rank its own shards on its own groups, or
trainer 0 alone the full tensors (the trainer ranks all-gather each bucket first: parallel/
weight_gather.py), so that an engine GPU is in `senders` = 1 weight group (+ 1 resharding
group) whatever the trainer count.

Whether the job goes on when an engine is lost (sync.engine_loss = continue) is decided here
too, since it depends on which groups can leave a member out (`survives_engine_loss`).

The plan counts what a rank joins (`groups_of`) without listing the whole job's groups, so
the scale checks (docs/scaling.md) can ask it at any size.
"""

from __future__ import annotations

from dataclasses import dataclass

from llamarl.config import reshards
from llamarl.parallel.groups import broadcasts, default_backend
from llamarl.parallel.shares import PromptShares, prompt_shares
from llamarl.runtime.layout import Layout

WEIGHTS, RESHARD, ROLLOUTS, COMMANDS = "weights", "reshard", "rollouts", "commands"


@dataclass(frozen=True)
class PlannedGroup:
    name: str  # the group's store namespace under the job's prefix
    ranks: tuple[int, ...]  # global ranks; group rank i is ranks[i]
    purpose: str  # WEIGHTS | RESHARD | ROLLOUTS | COMMANDS

    def rank_of(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)


def pair_group_name(trainer: int, engine: int) -> str:
    """The weight group of trainer rank `trainer` with engine `engine`'s tp ranks (pairs)."""
    return f"wsync{trainer}/pair{engine}"


def join_group_name(trainer: int, engine: int, incarnation: str) -> str:
    """The weight group of trainer rank `trainer` with (the tp ranks of) replacement
    `incarnation` of engine `engine` (parallel/weight_members.py)."""
    return f"wsync{trainer}/join{engine}.{incarnation}"


def channel_name(engine: int, trainer: int) -> str:
    """The rollout channel engine -> trainer rank (its store keys, its shm segment)."""
    return f"e{engine}t{trainer}"


@dataclass(frozen=True)
class CommPlan:
    layout: Layout
    backend: str  # "gloo" | "nccl": what the cross-role groups run on
    transport: str  # sync.transport: torch | filesystem | module path
    weight_pairs: bool  # weight groups per (trainer, engine), else one per trainer rank
    reshard_groups: bool  # per-tp-rank broadcast groups for resharded syncs
    survives_engine_loss: bool  # the job goes on when an engine is lost
    shares: PromptShares  # which engine sends which trainer rank which prompt groups
    one_sender: bool = False  # trainer 0 alone sends the weights, gathered (sync.senders)

    @property
    def senders(self) -> int:
        """How many trainer ranks send weights (trainer ranks 0 .. senders - 1); what each
        engine receives from, and how many shard layouts (`wsync/meta/<r>`) it reads."""
        return 1 if self.one_sender else self.layout.trainer_ranks

    # -- weights ------------------------------------------------------------------------
    def weight_groups(self, trainer: int) -> list[PlannedGroup]:
        """The groups trainer rank `trainer` sends its weight syncs on (group rank 0), in
        engine order for pairs (a transport other than torch's is handed them and may ignore
        them: the filesystem transport does); none for a trainer rank that does not send."""
        lay, t = self.layout, self.layout.trainer_global_ranks[trainer]
        if trainer >= self.senders:
            return []
        if self.weight_pairs:
            return [PlannedGroup(pair_group_name(trainer, e),
                                 (t, *lay.engine_global_ranks(e)), WEIGHTS)
                    for e in range(lay.engines)]
        return [PlannedGroup(f"wsync{trainer}", (t, *lay.generator_global_ranks), WEIGHTS)]

    def receiver_groups(self, global_rank: int) -> list[PlannedGroup]:
        """The weight groups generator rank `global_rank` receives on, one per sender
        in trainer order (the order the engines receive in, docs/architecture.md)."""
        lay = self.layout
        if not self.weight_pairs:
            return [g for r in range(self.senders) for g in self.weight_groups(r)]
        engine = lay.role_of(global_rank).index
        return [PlannedGroup(pair_group_name(r, engine),
                             (lay.trainer_global_ranks[r], *lay.engine_global_ranks(engine)),
                             WEIGHTS) for r in range(self.senders)]

    def reshard_groups_of(self, global_rank: int) -> list[PlannedGroup]:
        """Resharded syncs on broadcasts: [trainer r, tp rank k of every engine], one per
        (r, k). A sending trainer rank is in tp of them, a generator rank in one per sender."""
        if not self.reshard_groups:
            return []
        lay, role = self.layout, self.layout.role_of(global_rank)
        if role.role == "trainer":
            pairs = [(role.index, k) for k in range(lay.tp) if role.index < self.senders]
        else:
            pairs = [(r, role.tp_rank) for r in range(self.senders)]
        return [PlannedGroup(f"wsync{r}t{k}", (lay.trainer_global_ranks[r], *(
            lay.engine_global_ranks(e)[k] for e in range(lay.engines))), RESHARD)
            for r, k in pairs]

    # -- rollouts -----------------------------------------------------------------------
    def rollout_trainers(self, engine: int) -> list[int]:
        """The trainer ranks engine (slot) `engine` has a channel to (shares.py)."""
        return [route.trainer for route in self.shares.routes_of_engine(engine)]

    def rollout_engines(self, trainer: int) -> list[int]:
        """The engines trainer rank `trainer` has a channel from (shares.py)."""
        return self.shares.engines_of_trainer(trainer)

    def rollout_group(self, engine: int, trainer: int) -> PlannedGroup | None:
        """The pair group of channel engine -> trainer rank when its ends are on different
        nodes ([producer, consumer]); None when it goes through shared memory. Only for a
        channel of the plan (rollout_trainers)."""
        assert self.shares.linked(engine, trainer), (engine, trainer)
        lay = self.layout
        producer = lay.engine_global_ranks(engine)[0]
        consumer = lay.trainer_global_ranks[trainer]
        if lay.node_of(producer) == lay.node_of(consumer):
            return None
        return PlannedGroup(f"xfer/{channel_name(engine, trainer)}", (producer, consumer),
                            ROLLOUTS)

    # -- an engine's own tp ranks -------------------------------------------------------
    def command_group(self, engine: int, incarnation: str = "") -> PlannedGroup | None:
        """The command stream of a tp > 1 engine (generator/tp.py); a replacement's
        (`incarnation`, launch/join.py) is its own."""
        if self.layout.tp == 1:
            return None
        suffix = f".{incarnation}" if incarnation else ""
        return PlannedGroup(f"engine{engine}{suffix}/commands",
                            self.layout.engine_global_ranks(engine), COMMANDS)

    # -- counting -----------------------------------------------------------------------
    def groups_of(self, global_rank: int) -> list[PlannedGroup]:
        """Every group of the launch that rank `global_rank` joins (replacements' join
        groups are made later, one set per replacement, and are not counted)."""
        role = self.layout.role_of(global_rank)
        if role.role == "trainer":
            out = self.weight_groups(role.index)
            rollouts = [self.rollout_group(e, role.index)
                        for e in self.rollout_engines(role.index)]
        else:
            out = self.receiver_groups(global_rank)
            command = self.command_group(role.index)
            out += [command] if command is not None else []
            rollouts = ([self.rollout_group(role.index, r)
                         for r in self.rollout_trainers(role.index)]
                        if role.is_engine_leader else [])
        return out + self.reshard_groups_of(global_rank) + [g for g in rollouts if g]


    def gpu_communicators(self, global_rank: int) -> list[PlannedGroup]:
        """The groups of `groups_of` that are NCCL communicators on this rank's GPU (on an
        NCCL plan: the weight and resharding groups; rollout pairs and an engine's command
        stream are gloo, buffer/dist_channel.py, generator/tp.py); none on gloo."""
        if self.backend != "nccl":
            return []
        return [g for g in self.groups_of(global_rank) if g.purpose in (WEIGHTS, RESHARD)]


def plan_for(rt) -> CommPlan:
    """The plan of a running job (a runtime.setup.Runtime): its groups on NCCL when this rank
    is on a GPU, on gloo on the CPU."""
    return comm_plan(rt.cfg, rt.layout, default_backend(rt.device))


def comm_plan(cfg, layout: Layout, backend: str) -> CommPlan:
    """The plan of a recipe (a Config) on `layout` with cross-role groups on `backend`."""
    pairs = weight_pairs(cfg, layout, backend)
    reshard = (not pairs and layout.tp > 1 and reshards(cfg) and broadcasts(backend))
    return CommPlan(layout, backend, cfg.sync.transport, pairs, reshard,
                    survives_engine_loss(cfg, layout, backend),
                    prompt_shares(cfg, layout.engines, layout.trainer_ranks),
                    one_sender(cfg, layout, backend))


def one_sender(cfg, layout: Layout, backend: str) -> bool:
    """Whether trainer 0 alone sends the weights (sync.senders): `one` with more than one
    trainer rank on the torch transport; `auto` too on NCCL, where one sender's link bounds
    a broadcast to every engine anyway (docs/scaling.md), and the T weight communicators per
    engine GPU of `every` would grow with the trainers. On gloo `auto` keeps `every`: the
    T trainer links work in parallel and the CPU recipes' syncs stay what they were."""
    if cfg.sync.transport != "torch" or layout.trainer_ranks == 1:
        return False
    if cfg.sync.senders != "auto":
        return cfg.sync.senders == "one"
    return backend == "nccl"


def weight_pairs(cfg, layout: Layout, backend: str) -> bool:
    """Whether the torch transport's weight groups are one per (trainer rank, engine),
    `wsync<r>/pair<e>` = [trainer r, engine e's tp ranks], sent to point to point, rather
    than one per trainer rank with every engine (sync.weight_groups). On NCCL a lost engine's
    pair groups are aborted (parallel/weight_members.py) and the others go on; one broadcast
    group could not leave it out."""
    if cfg.sync.transport != "torch":
        return False
    if cfg.sync.weight_groups != "auto":
        return cfg.sync.weight_groups == "pairs"
    return (backend == "nccl" and cfg.sync.engine_loss == "continue"
            and layout.engines >= 2 and layout.nodes == 1)


def survives_engine_loss(cfg, layout: Layout, backend: str) -> bool:
    """Whether the job goes on when an engine is lost (sync.engine_loss, docs/operations.md):
    another engine must be left, and nothing that spans the lost engine may be a collective
    that cannot leave a member out:

    * gloo (CPU): weight groups whose point-to-point sends can leave a member out
      (sync.transport torch), or the filesystem transport, which waits for no receiver;
      rollouts across hosts go point to point on gloo pair groups too;
    * NCCL (GPU): the filesystem transport on one node. Its weights wait for no receiver and
      its rollouts go through shared memory (across nodes they take gloo pair groups), and
      the torch transport's NCCL broadcast cannot drop a member (docs/operations.md says what
      is left).

    Batch and continuous generation both hand slots over at batch boundaries
    (generator/slots.py). An engine of tp > 1 is lost whole (runtime/watchdog.py: its other
    ranks leave with a dead one)."""
    if cfg.sync.engine_loss != "continue" or layout.engines < 2:
        return False
    if backend == "gloo":
        return cfg.sync.transport in ("torch", "filesystem")
    return layout.nodes == 1 and (cfg.sync.transport == "filesystem"
                                  or weight_pairs(cfg, layout, backend))
