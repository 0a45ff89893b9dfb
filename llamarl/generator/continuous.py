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
        once the `prompts_per_step / engines` groups submitted first are complete and the
            trainer has room: ship them as batch b, b += 1

Each token records the version that sampled it (Completion.versions -> one Sample segment per
span), so a sample's policy_version is its oldest token and sync.max_staleness bounds that:
a group whose oldest token is older than b - k when batch b ships is discarded (the trainer
would drop it) and counted. With several engines each runs this loop on its own prompt shard.

The held-out evaluation pauses the running sequences (Engine.generate) and continues them
after. The loader's position saved with each batch is past every prompt drawn so far: a
resumed run skips the prompts that were in flight at the crash (none is trained on twice).
"""

from __future__ import annotations

import time

from llamarl.buffer.record import Sample, split_groups
from llamarl.generator.engine import Completion, sampler_seed
from llamarl.launch.runtime import Runtime
from llamarl.rewards.dynamic_sampling import is_informative
from llamarl.rewards.scorer import ScoredGroup, score_groups

_IDLE_S = 0.002  # sleep while nothing runs and the trainer has no room


class GroupPool:
    """Prompt groups running on the engine: G requests each, complete when all G are."""

    def __init__(self, engine, n: int, temperature: float, max_tokens: int):
        self.engine, self.n = engine, n
        self.temperature, self.max_tokens = temperature, max_tokens
        self.groups: dict[int, tuple[object, list[Completion | None]]] = {}
        self.submitted = 0  # groups submitted so far; the next one's number

    def submit(self, prompt) -> None:
        gid, self.submitted = self.submitted, self.submitted + 1
        self.groups[gid] = (prompt, [None] * self.n)
        for i in range(self.n):
            self.engine.submit(f"{gid}/{i}", prompt.token_ids, self.temperature,
                               self.max_tokens)

    def step(self) -> list[tuple[int, object, list[Completion]]]:
        """One engine step; the groups it completed, as (group number in order of
        submission, prompt, G completions)."""
        done = []
        for request_id, c in self.engine.step():
            gid, i = map(int, request_id.split("/"))
            prompt, completions = self.groups[gid]
            completions[i] = c
            if all(x is not None for x in completions):
                del self.groups[gid]
                done.append((gid, prompt, completions))
        return done


class Meter:
    """What the engine did since the last batch shipped (the batch's rollout metrics)."""

    def __init__(self, engine):
        self.engine = engine
        self.reset()

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.busy_s = self.generate_s = self.reward_s = 0.0
        self.steps = self.running_sum = 0
        self.stale = self.uninformative = self.filled = 0
        self.reward_errors = self.reward_timeouts = 0
        self.recomputed0 = self.engine.recomputed_tokens

    def metrics(self, groups: list[ScoredGroup]) -> dict:
        samples = [s for g in groups for s in g.samples]
        spreads = [max(vs) - min(vs) for vs in
                   ([v for v in s.versions if v >= 0] for s in samples) if vs]
        wall = max(time.perf_counter() - self.t0, 1e-9)
        return {"continuous": 1.0,
                "engine_busy_s": self.busy_s, "wall_s": wall,
                "in_flight_mean": self.running_sum / max(self.steps, 1),
                "version_spread_sum": float(sum(spreads)),
                "spanning_samples": float(sum(1 for x in spreads if x > 0)),
                "samples": float(len(samples)),
                "stale_groups_discarded": float(self.stale),
                "recomputed_tokens": float(self.engine.recomputed_tokens - self.recomputed0)}


def run_continuous(rt: Runtime, engine, scorer, loader, weights, channels, timeline,
                   b: int, to_batch, data_bad_rows: int) -> None:
    """Engine e's continuous loop from batch `b` until the trainer's final version is loaded.
    `to_batch(groups, engine, step, stride)` builds a RolloutBatch (generator/loop.py)."""
    cfg, g, e = rt.cfg, rt.cfg.generator, rt.role.index
    k, n = cfg.sync.max_staleness, g.samples_per_prompt
    per_engine = g.prompts_per_step // rt.layout.engines
    room_for = g.in_flight_sequences or per_engine * n
    pool = GroupPool(engine, n, g.temperature, g.max_new_tokens)
    meter = Meter(engine)
    ready: list[ScoredGroup] = []
    engine.version = weights.version
    engine.begin(sampler_seed(cfg.run.seed, "continuous", b, e))
    try:
        while weights.follow(need=b - k):
            if weights.trainer_done():  # only its final weights are left to load
                engine.abort_all()
                time.sleep(_IDLE_S)
                continue
            if len(ready) >= per_engine and all(ch.unconsumed() < ch.capacity
                                                for ch in channels):
                shipped, ready = _ship(rt, ready, min(pool.groups, default=pool.submitted),
                                       per_engine, b, meter, loader, channels, weights,
                                       timeline, to_batch, data_bad_rows)
                b += shipped
                if shipped:
                    continue
            # Admit a new group only if it can still be fresh where it will land: behind the
            # groups ready and running, in batch b + (ready + running) // per_engine, whose
            # oldest token may be no older than that batch - k. Ahead of that (the trainer is
            # the bottleneck) the engine finishes what runs and waits, rather than sampling
            # groups that would be discarded as stale.
            while (engine.running + n <= room_for and
                   engine.version >= b + (len(ready) + len(pool.groups)) // per_engine - k):
                pool.submit(loader.next(1)[0])
            if not engine.busy:
                rt.watchdog.check()
                time.sleep(_IDLE_S)
                continue
            t0 = time.perf_counter()
            running = engine.running
            done = pool.step()
            t1 = time.perf_counter()
            meter.busy_s += t1 - t0
            meter.steps += 1
            meter.running_sum += running
            if done:
                ready += _score(rt, scorer, done, meter, engine.version)
                meter.reward_s += time.perf_counter() - t1
    finally:
        engine.abort_all()


def _score(rt: Runtime, scorer, done, meter: Meter, version: int) -> list[ScoredGroup]:
    """Score completed groups; with dynamic sampling drop those whose rewards are all equal
    (counted: ds_dropped_groups)."""
    prompts = [p for _, p, _ in done]
    scored, scores = score_groups(scorer, prompts, [c for _, _, c in done], 0, shaped=True)
    meter.reward_errors += scores.errors
    meter.reward_timeouts += scores.timeouts
    g = rt.cfg.generator
    # a policy whose every group is uninformative must not loop forever: after
    # max_sampling_rounds batches' worth of dropped groups, they fill (as in batch mode)
    give_up = g.max_sampling_rounds * (g.prompts_per_step // rt.layout.engines)
    kept = []
    for (gid, _, _), grp in zip(done, scored):
        grp.index = gid  # the order of submission, until the group ships
        for c in grp.completions:
            s = Sample(finish="stop" if c.finish_reason == "stop" else "length")
            s.add_context(grp.prompt.token_ids)
            s.add_completion(c, version)
            grp.samples.append(s)
        if g.dynamic_sampling and not is_informative(grp.rewards):
            if meter.uninformative < give_up:
                meter.uninformative += 1
                continue
            meter.filled += 1
        kept.append(grp)
    return kept


def _ship(rt: Runtime, ready: list[ScoredGroup], oldest_running: int, per_engine: int,
          b: int, meter: Meter, loader, channels, weights, timeline, to_batch,
          data_bad_rows: int):
    """Ship batch b: the `per_engine` complete groups submitted first, once no group
    submitted before them still runs. Returns (shipped, the groups left); nothing is left when
    the trainer finished while the batch waited.

    In order of submission, not of completion: shorter groups submitted later never overtake
    a long one, which would push long responses towards staleness and out of the batches (a
    length bias); a group is shipped in the batch its admission counted on, fresh by
    construction (a group still older than b - k, possible after dynamic sampling drops, is
    discarded and counted)."""
    k = rt.cfg.sync.max_staleness
    fresh = [grp for grp in ready
             if min(min((v for v in s.versions if v >= 0), default=b) for s in grp.samples)
             >= b - k]
    meter.stale += len(ready) - len(fresh)
    if len(fresh) < per_engine:  # generate more first
        return False, fresh
    fresh.sort(key=lambda grp: grp.index)
    if sum(grp.index < oldest_running for grp in fresh) < per_engine:
        return False, fresh  # an earlier group still runs: wait for it
    take, rest = fresh[:per_engine], fresh[per_engine:]
    for j, grp in enumerate(take):
        grp.index = j
    batch = to_batch(take, rt.role.index, b, per_engine)
    rollout = meter.metrics(take)
    rewards = {name: sum(sum(grp.components[name]) for grp in take) / len(batch)
               for name in take[0].components}
    batch.info.update(
        step=b, generate_s=rollout["wall_s"], reward_s=meter.reward_s,
        reward_errors=meter.reward_errors, reward_timeouts=meter.reward_timeouts,
        rollout=rollout, tokens=int(batch.loss_mask.sum()), reward_components=rewards,
        ds_rounds=1, ds_dropped_groups=meter.uninformative, ds_filled_groups=meter.filled,
        engine=rt.role.index, data_state=loader.state_dict(), data_epoch=loader.epoch,
        data_bad_rows=data_bad_rows, prev_put_s=sum(ch.last_put_s for ch in channels))
    with timeline.phase("put", b):
        for t, part in enumerate(split_groups(batch, rt.layout.trainer_ranks)):
            if not channels[t].put(part, abort=weights.trainer_done):
                return False, []
    meter.reset()
    return True, rest
