"""Continuous generation (generator.mode: continuous): the engine never drains.

Batch mode generates a whole batch, waits for its longest response, then stops to load
weights. Here engine e keeps up to `in_flight_sequences` sequences running:

    submit prompt groups (G samples each) while there is room and the group can still be
        fresh in the batch it will land in
    loop, between two engine steps:
        load every weight broadcast announced (Engine.swap_weights: running sequences go on
            under the new weights, their KV recomputed or kept: generator.in_flight_kv);
            block only while the loaded version V < b - k
        one engine step; a group is complete when its G samples are: score it
        once the slot's share of the step's groups is complete and the trainer has room: ship
            them as batch b (the oldest first, and never leaving a running group behind its
            deadline: pick_batch), b += 1

Each token records the version that sampled it (Completion.versions -> one Sample segment per
span), so a sample's policy_version is its oldest token and sync.max_staleness bounds that: a
group started under version v must ship by batch v + k (its deadline), and a batch waits for a
running group only when that group, or the groups older than it, would otherwise miss theirs.
With several engines each runs this loop on its own prompt shard (its slot, and the slots of
lost engines it takes over: run_continuous).

The held-out evaluation pauses the running sequences (Engine.generate) and continues them
after. The loader's position saved with each batch is past every prompt drawn so far: a
resumed run skips the prompts that were in flight at the crash (none is trained on twice).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from llamarl.buffer.record import episode_counts
from llamarl.generator.engine import Completion, sampler_seed
from llamarl.generator.samples import append_rows, sample_rows
from llamarl.generator.slots import SlotSet
from llamarl.generator.weights import fresh_version
from llamarl.rewards.dynamic_sampling import is_informative
from llamarl.rewards.scorer import ScoredGroup, group_counts, score_groups
from llamarl.rollout.single_turn import completion_sample
from llamarl.runtime.setup import Runtime

_IDLE_S = 0.002  # sleep while nothing runs and the trainer has no room
_REFRESH_S = 0.5  # look at the roster (slots taken over or handed back) at least this often


def admits(version: int, target: int, k: int, every: int, prefer_fresh: bool,
           queued: Callable[[], bool]) -> bool:
    """Whether a prompt group for batch `target` may start under the loaded `version`: never
    older than target - k (its oldest token bounds the sample's staleness); with
    sync.prefer_fresh, only from the version the trainer publishes just before it takes batch
    target - 1 (weights.fresh_version) while `queued()`: the trainer still has a batch of
    this engine to train on and does not wait for the group meanwhile, as in batch mode
    (run_continuous: and the engine is not behind the trainer). Without it every group
    started as early as the bound allows, k versions old."""
    if version < target - k:
        return False
    if not prefer_fresh or version >= fresh_version(target, k, every):
        return True
    return not queued()


def pick_batch(ready: dict[int, int], started: dict[int, int], b: int, k: int,
               per_batch: int) -> list[int] | None:
    """The groups batch b ships, or None while it must wait for a running group.

    `started`: every group not shipped yet (running or complete; gid -> the version loaded
    when it started, which bounds its oldest token from below); `ready`: the complete ones
    among them (gid -> that version). A group started under version v has the deadline v + k:
    a later batch would find it more than k versions old.

    Complete groups ship oldest first (earliest deadline first, then in order of submission),
    so a short response may overtake a long one, but only while the groups left behind can
    all still ship by their deadlines, `per_batch` a batch: sorted by version, the j-th
    (0-based) of them lands in batch b + 1 + j // per_batch at the earliest, so each must have
    v + k >= that batch. If the oldest complete groups leave that false, no choice of complete
    groups makes it true (they leave the most old groups behind), and the batch waits for the
    running ones. Admission keeps the groups of each deadline within the batches before it
    (run_continuous), so a group is never discarded as stale; a long response is only shipped
    later than the short ones started with it, never dropped (no length bias in what is
    trained on, only in how old it is, within k)."""
    if len(ready) < per_batch:
        return None
    take = sorted(ready, key=lambda gid: (ready[gid], gid))[:per_batch]
    chosen = set(take)
    left = sorted(v for gid, v in started.items() if gid not in chosen)
    if any(v + k < b + 1 + j // per_batch for j, v in enumerate(left)):
        return None
    return sorted(take)


class AheadOfTrainer:
    """Whether an engine keeps ahead of the trainer, for sync.prefer_fresh: it holds a new
    group back for fresher weights only while a batch of it is queued (admits) and one was
    whenever it shipped its last k batches.

    A batch that found none of the engine's queued means the trainer had taken everything and
    was about to wait for this engine: it is the trainer's bottleneck, and for the next k
    batches (the window its groups' deadlines span) waiting for fresher weights would make the
    trainer wait again. On the long-tailed `deep` workload of bench/continuous_generation.py
    the engine was held back 11% of the time before, 2% with this (docs/measured.md); an
    engine faster than the trainer (the default recipe) keeps holding back and samples as
    fresh as before."""

    def __init__(self, k: int):
        self.k = k
        self.shipped_ahead = k  # batches shipped since the last one that found none queued

    def shipped(self, found_queued: bool) -> None:
        self.shipped_ahead = self.shipped_ahead + 1 if found_queued else 0

    def keeps(self) -> bool:
        return self.shipped_ahead >= self.k


class GroupPool:
    """Single-turn prompt groups running on the engine: G requests each, complete when all G
    are; step() scores what completed (reward.*) and returns ScoredGroups whose index is
    their number in order of submission."""

    def __init__(self, engine, scorer, n: int, temperature: float, max_tokens: int):
        self.engine, self.scorer, self.n = engine, scorer, n
        self.temperature, self.max_tokens = temperature, max_tokens
        self.groups: dict[int, tuple[object, list[Completion | None]]] = {}
        self.submitted = 0  # groups submitted so far; the next one's number
        self.reward_errors = self.reward_timeouts = 0
        self.reward_s = 0.0
        self.metrics: dict[str, float] = {}  # none beyond Meter's

    @property
    def running(self) -> int:  # sequences that hold a place in the engine
        return self.engine.running

    @property
    def busy(self) -> bool:
        return self.engine.busy

    def submit(self, prompt) -> None:
        gid, self.submitted = self.submitted, self.submitted + 1
        self.groups[gid] = (prompt, [None] * self.n)
        for i in range(self.n):
            self.engine.submit(f"{gid}/{i}", prompt.token_ids, self.temperature,
                               self.max_tokens)

    def abort(self, gid: int) -> None:
        """Stop group `gid` (running): its samples not finished leave the engine."""
        _, completions = self.groups.pop(gid)
        self.engine.abort([f"{gid}/{i}" for i, c in enumerate(completions) if c is None])

    def step(self) -> list[ScoredGroup]:
        done = []
        for request_id, c in self.engine.step():
            gid, i = map(int, request_id.split("/"))
            prompt, completions = self.groups[gid]
            completions[i] = c
            if all(x is not None for x in completions):
                del self.groups[gid]
                done.append((gid, prompt, completions))
        if not done:
            return []
        t0 = time.perf_counter()
        scored, scores = score_groups(self.scorer, [p for _, p, _ in done],
                                      [c for _, _, c in done], 0, shaped=True)
        self.reward_errors += scores.errors
        self.reward_timeouts += scores.timeouts
        for (gid, _, _), grp in zip(done, scored):
            grp.index = gid
            grp.samples += [completion_sample(grp.prompt.token_ids, c, self.engine.version)
                            for c in grp.completions]
        self.reward_s += time.perf_counter() - t0
        return scored


class EpisodePool:
    """Episode prompt groups (the source's runner, a rollout/episodes.py EpisodeRunner:
    multi_turn.py's EnvRunner or agent_source.py's AgentRunner): G episodes each, complete
    when all G have their reward; episodes waiting for a tool (or an agent) hold a place
    too."""

    def __init__(self, engine, source, n: int, temperature: float):
        self.engine, self.n = engine, n
        self.runner = source.runner(temperature, spans=True)
        self.submitted = 0
        self.reward_errors = self.reward_timeouts = 0  # the environment rewards: none
        self.reward_s = 0.0

    @property
    def groups(self) -> dict:
        return self.runner.groups

    @property
    def metrics(self) -> dict[str, float]:
        return self.runner.metrics

    @property
    def running(self) -> int:
        return self.runner.live

    @property
    def busy(self) -> bool:
        return self.runner.live > 0

    def submit(self, prompt) -> None:
        self.runner.add(self.submitted, prompt, self.n)
        self.submitted += 1

    def abort(self, gid: int) -> None:
        self.runner.abort(gid)

    def step(self) -> list[ScoredGroup]:
        return self.runner.step(self.engine.version)


class Meter:
    """What the engine did since the last batch shipped (the batch's rollout metrics; the
    trainer sums them over the engines with rollout/continuous_metrics.py)."""

    def __init__(self, engine, pool):
        self.engine, self.pool = engine, pool
        # dynamic sampling, per slot since its last batch (an engine may make several slots):
        # groups dropped as uninformative, and groups kept after the budget was spent
        self.uninformative: dict[int, int] = {}
        self.filled: dict[int, int] = {}
        self.reset()

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.busy_s = self.load_s = self.held_s = self.due_s = 0.0
        self.steps = self.running_sum = 0
        self.stale = 0
        self.recomputed0 = self.engine.recomputed_tokens
        self.reward_s0, self.errors0 = self.pool.reward_s, self.pool.reward_errors
        self.timeouts0 = self.pool.reward_timeouts
        for key in self.pool.metrics:  # multi-turn episode counts
            self.pool.metrics[key] = 0.0

    def metrics(self, groups: list[ScoredGroup]) -> dict:
        samples = [s for g in groups for s in g.samples]
        spreads = [max(vs) - min(vs) for vs in
                   ([v for v in s.versions if v >= 0] for s in samples) if vs]
        wall = max(time.perf_counter() - self.t0, 1e-9)
        return {"continuous": 1.0,
                # in engine calls: stepping, and adding the requests of new groups
                "engine_busy_s": self.busy_s, "wall_s": wall,
                # not stepping: loading weights (or blocked for them), and held back with
                # nothing admissible (the trainer has no room, or a new group could not be
                # fresh where it would land: the trainer is the bottleneck)
                "engine_load_s": self.load_s, "engine_held_s": self.held_s,
                # stepping while enough groups were complete for the batch, but a running
                # group was due in it (its oldest token would be too old for the next one)
                "engine_due_s": self.due_s,
                "in_flight_mean": self.running_sum / max(self.steps, 1),
                "version_spread_sum": float(sum(spreads)),
                "spanning_samples": float(sum(1 for x in spreads if x > 0)),
                "samples": float(len(samples)),
                "stale_groups_discarded": float(self.stale),
                "recomputed_tokens": float(self.engine.recomputed_tokens - self.recomputed0)}


def run_continuous(rt: Runtime, engine, scorer, source, slots: SlotSet, weights, timeline,
                   to_batch, data_bad_rows: int) -> None:
    """Engine e's continuous loop until the trainer's final version is loaded, for the slots
    it makes (generator/slots.py: its own, and those of lost engines it took over). `source`:
    the episode source (multi_turn: its environment workers; agent: its gateway and agent
    workers), or None for single-turn sampling scored
    by `scorer`. `to_batch(groups, slot, step, stride)` builds a RolloutBatch
    (generator/loop.py).

    Each group is drawn from one slot's prompts and ships in one of that slot's batches; a new
    group goes to the slot whose batches are owed soonest. Slots change hands at the batch
    boundaries of the slot (SlotSet.refresh, looked at after each batch shipped and every
    _REFRESH_S): a slot taken over starts from the loader state its lost engine wrote before
    its next batch; a slot handed back to a replacement leaves its running and complete groups
    behind, unshipped (the loader state the replacement continues from is past them, as a
    resumed run is past the groups in flight at a crash); those running stop."""
    cfg, g, e = rt.cfg, rt.cfg.generator, rt.role.index
    k, n = cfg.sync.max_staleness, g.samples_per_prompt
    share = slots.per_slot  # groups of a slot's batch (parallel/shares.py)
    stride = slots.shares.most_of_an_engine  # the largest share: group ids, room
    room_for = g.in_flight_sequences or stride * n
    pool = (EpisodePool(engine, source, n, g.temperature) if source is not None
            else GroupPool(engine, scorer, n, g.temperature, g.max_new_tokens))
    meter = Meter(engine, pool)
    ready: list[ScoredGroup] = []  # complete groups
    started: dict[int, tuple[int, int]] = {}  # every group not shipped: number -> (slot,
    # version at start)

    ahead = AheadOfTrainer(k)

    def admissible(target: int) -> bool:
        return admits(engine.version, target, k, cfg.sync.every, cfg.sync.prefer_fresh,
                      queued=lambda: ahead.keeps() and slots.queued())

    def owed(slot) -> int:  # the batch a new group of this slot lands in at the latest
        return (slot.next_batch
                + sum(s == slot.index for s, _ in started.values()) // share(slot.index))

    engine.version = weights.version
    engine.begin(sampler_seed(cfg.run.seed, "continuous", slots.first_batch, e))
    refreshed = 0.0
    try:
        while True:
            if weights.final is None and time.perf_counter() - refreshed >= _REFRESH_S:
                slots.refresh()
                refreshed = time.perf_counter()
                for gid in [gid for gid, (s, _) in started.items() if s not in slots.slots]:
                    del started[gid]  # a slot handed back: its groups stay unshipped, and
                    if gid in pool.groups:  # those running stop
                        pool.abort(gid)
                ready = [grp for grp in ready if grp.index in started]
                for counts in (meter.uninformative, meter.filled):
                    for s in [s for s in counts if s not in slots.slots]:
                        del counts[s]
            if not slots.ready():  # a replacement whose slot is not handed back yet
                if weights.follow(need=1 << 62, interrupt=slots.changed) is False:
                    break
                refreshed = 0.0
                continue
            # (a slot the roster gives another engine now makes nothing more: it is handed
            # back once the slots kept have caught up with it, SlotSet.refresh)
            live = sorted((sl for sl in slots.slots.values()
                           if sl.next_batch is not None and sl.index not in slots.leaving),
                          key=lambda sl: (sl.next_batch, sl.index))
            got = _timed_follow(weights, live[0].next_batch - k, meter, slots.changed)
            if got is None:  # slots changed hands while waiting (the trainer may need a
                refreshed = 0.0  # batch of a slot this engine is taking over first)
                continue
            if not got:
                break
            # only the trainer's final weights are left to load (follow() has just asked the
            # store and keeps the answer: no second round trip per engine step)
            if weights.final is not None:
                engine.abort_all()
                time.sleep(_IDLE_S)
                continue
            due = False  # a batch waits only for a running group due in it (pick_batch)
            shipped = False
            for slot in live:
                mine = [grp for grp in ready if started[grp.index][0] == slot.index]
                if len(mine) < share(slot.index) or any(ch.unconsumed() >= ch.capacity
                                                        for ch in slot.channels.values()):
                    continue
                others = [grp for grp in ready if started[grp.index][0] != slot.index]
                was_queued = slots.queued()
                shipped, left = _ship(rt, slots, slot, mine, started, share(slot.index),
                                      stride, meter, pool, weights, timeline, to_batch,
                                      data_bad_rows)
                ready = others + left
                if shipped:
                    ahead.shipped(found_queued=was_queued)
                    break
                due = due or len(left) >= share(slot.index)
            if shipped:
                refreshed = 0.0  # a batch boundary: slots may change hands here
                continue
            # Admit a new group only if it can still be fresh where it lands at the latest:
            # behind its slot's groups not shipped yet (ready and running), in batch owed(),
            # whose oldest token may be no older than that batch - k (fresher with
            # prefer_fresh). This keeps the groups of each deadline within the batches before
            # it (pick_batch). Ahead of that (the trainer is the bottleneck) the engine
            # finishes what runs and waits.
            while pool.running + n <= room_for:
                target, _, slot = min((owed(sl), sl.index, sl) for sl in live)
                if not admissible(target):
                    break
                started[pool.submitted] = (slot.index, engine.version)
                prompt = slot.loader.next(1)[0]
                t0 = time.perf_counter()
                pool.submit(prompt)
                # a single-turn group is G requests added to vLLM (its input processing:
                # engine work); a multi-turn one asks its environments to open first
                if source is None:
                    meter.busy_s += time.perf_counter() - t0
            if not pool.busy:
                rt.watchdog.check()
                t0 = time.perf_counter()
                time.sleep(_IDLE_S)
                meter.held_s += time.perf_counter() - t0
                continue
            t0, reward0 = time.perf_counter(), pool.reward_s
            running, stepped = engine.running, engine.busy
            done = pool.step()
            if stepped:  # (a multi-turn pool may only have polled its environment)
                step_s = time.perf_counter() - t0 - (pool.reward_s - reward0)
                meter.busy_s += step_s
                meter.due_s += step_s if due else 0.0
                meter.steps += 1
                meter.running_sum += running
            # (a group of a slot handed back meanwhile is not kept)
            ready += _keep(rt, [grp for grp in done if grp.index in started], meter, started)
    finally:
        engine.abort_all()


def _timed_follow(weights, need: int, meter: Meter, interrupt) -> bool | None:
    t0 = time.perf_counter()
    try:
        return weights.follow(need=need, interrupt=interrupt)
    finally:
        meter.load_s += time.perf_counter() - t0


def _keep(rt: Runtime, done: list[ScoredGroup], meter: Meter,
          started: dict[int, tuple[int, int]]) -> list[ScoredGroup]:
    """Completed groups to keep: with dynamic sampling not those whose rewards are all equal
    (counted: ds_dropped_groups; forgotten from `started`)."""
    g = rt.cfg.generator
    if not g.dynamic_sampling:
        return done
    # a policy whose every group is uninformative must not loop forever: after
    # max_sampling_rounds batches' worth of dropped groups, they fill (as in batch mode)
    give_up = g.max_sampling_rounds * (-(-g.prompts_per_step // rt.layout.engines))
    kept = []
    for grp in done:
        if not is_informative(grp.rewards):
            slot = started[grp.index][0]
            if meter.uninformative.get(slot, 0) < give_up:
                meter.uninformative[slot] = meter.uninformative.get(slot, 0) + 1
                del started[grp.index]
                continue
            meter.filled[slot] = meter.filled.get(slot, 0) + 1
        kept.append(grp)
    return kept


def _ship(rt: Runtime, slots: SlotSet, slot, ready: list[ScoredGroup],
          started: dict[int, tuple[int, int]], per_batch: int, stride: int, meter: Meter,
          pool, weights, timeline, to_batch,
          data_bad_rows: int) -> tuple[bool, list[ScoredGroup]]:
    """Ship the slot's next batch b: `per_batch` of its complete groups (`ready`), chosen by
    pick_batch (`stride`: the largest slot share, which numbers group ids). Returns (shipped,
    its groups left).

    A group whose oldest token is older than b - k cannot happen by pick_batch's deadlines;
    should one (a safety net), it is discarded and counted in stale_groups_discarded."""
    k, b = rt.cfg.sync.max_staleness, slot.next_batch
    fresh = []
    for grp in ready:
        if min(min((v for v in s.versions if v >= 0), default=b) for s in grp.samples) >= b - k:
            fresh.append(grp)
        else:
            meter.stale += 1
            del started[grp.index]
    gids = pick_batch({grp.index: started[grp.index][1] for grp in fresh},
                      {gid: v for gid, (s, v) in started.items() if s == slot.index}, b, k,
                      per_batch)
    if gids is None:  # generate more first
        return False, fresh
    chosen = set(gids)
    take = sorted((grp for grp in fresh if grp.index in chosen), key=lambda grp: grp.index)
    rest = [grp for grp in fresh if grp.index not in chosen]
    for gid in gids:
        del started[gid]
    for j, grp in enumerate(take):
        grp.index = j
    batch = to_batch(take, slot.index, b, stride)
    if rt.cfg.run.samples_per_step and slot.index == 0:  # a few to read (generator/samples.py)
        append_rows(rt.run_dir / "samples" / "train.jsonl",
                    sample_rows(take, pool.engine.tokenizer, b + 1, "train",
                                rt.cfg.run.samples_per_step))
    rollout = meter.metrics(take)
    if pool.metrics:  # multi-turn: tool and environment counts since the last batch; the
        # episodes, turns and the counts kept with each group (agent) are the batch's own
        rollout.update(pool.metrics, collect_s=rollout["wall_s"], **episode_counts(batch),
                       episodes=float(len(batch)), turns=float(batch.turns.sum()),
                       engine_busy_s=rollout["engine_busy_s"], **group_counts(take))
    rewards = {name: sum(sum(grp.components[name]) for grp in take) / len(batch)
               for name in take[0].components}
    batch.info.update(
        step=b, generate_s=rollout["wall_s"], reward_s=pool.reward_s - meter.reward_s0,
        reward_errors=pool.reward_errors - meter.errors0,
        reward_timeouts=pool.reward_timeouts - meter.timeouts0,
        rollout=rollout, tokens=int(batch.loss_mask.sum()), reward_components=rewards,
        ds_rounds=1, ds_dropped_groups=meter.uninformative.pop(slot.index, 0),
        ds_filled_groups=meter.filled.pop(slot.index, 0),
        engine=slot.index, made_by=rt.role.index, data_state=slot.loader.state_dict(),
        data_epoch=slot.loader.epoch, data_bad_rows=data_bad_rows,
        prev_put_s=slots.last_put_s())
    with timeline.phase("put", b):  # (returns at once when the trainer has finished)
        slots.put(slot, batch, abort=weights.trainer_done)
    meter.reset()
    return True, rest
