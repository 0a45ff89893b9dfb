"""The generator role: sample, score, ship rollouts, load new weights, evaluate.

Loop of engine e with max_staleness = k, V = version of the loaded weights:

    eval(V=0)
    for b = 0, 1, 2, ...:                              # b: rollout batch index = trainer step
        receive every announced weight broadcast; block until V >= b - k
        (sync.prefer_fresh, k >= 2: while batch b - 1 of this engine is still unconsumed,
         block on until V >= b - 1, the version the trainer publishes before taking it)
        stop once V reaches the trainer's final version
        groups = source.collect(next prompts of shard e, n samples each)      # policy V
            (generator.mode = continuous: generator/continuous.py instead; the engine never
             drains and loads weights between two engine steps)
            (rollout.source: single-turn sampling + reward.*, or multi-turn episodes of
             rollout.env; with dynamic sampling: repeat for the groups dropped)
        send each trainer rank its run of the groups (parallel/shares.py); put()
            (each batch carries the prompt loader's state after it: the trainer saves the state
             of the last batch it trained on, and a resumed generator continues from there)
        (eval(V) whenever V passes an eval point)

k = 0 is strictly on-policy: batch b is sampled from exactly the weights of trainer step b.
With k >= 1 generation of batch b overlaps training on batch b - 1 and the trainer sees
samples at most k versions old.

A tp > 1 engine runs this loop on its leader (tp rank 0) alone; its other tp ranks make the
same engine calls in lockstep (generator/tp.py).

Why prefer fresh weights: a generator faster than the trainer runs as far ahead as k allows, so
every sample would be exactly k versions old. While its previous batch is still queued, the
trainer cannot want batch b before it has published version b - 1 and trained one step on
batch b - 1; sampling b from version b - 1 (as with k = 1) costs it nothing in steady state.
k then bounds only batches made while the buffer is empty, i.e. when generation falls behind.
"""

from __future__ import annotations

import functools
import os
import time

from llamarl.buffer.record import RolloutBatch, episode_counts
from llamarl.config import RECIPE_TEACHERS, adapter_sync, reshards
from llamarl.data.dataset import PromptData, load_prompt_data
from llamarl.data.prompts import PromptFormatter
from llamarl.generator.continuous import run_continuous
from llamarl.generator.cpu_fixes import cpu_shm_prefix, unlink_cpu_shm
from llamarl.generator.engine import Engine, EngineWorld, import_vllm, sampler_seed
from llamarl.generator.evaluate import Evaluator
from llamarl.generator.gpu_memory import later_bytes, reward_model_bytes
from llamarl.generator.lora_adapter import adapter_config
from llamarl.generator.samples import append_rows, sample_rows
from llamarl.generator.slots import SlotSet
from llamarl.generator.tp import EngineCommands, follow_leader
from llamarl.generator.weights import WeightFollower, fresh_version
from llamarl.parallel.groups import planned_spec
from llamarl.parallel.plan import plan_for
from llamarl.parallel.weight_sync import engine_transport, replacement_transport, sender_metas
from llamarl.rewards.dynamic_sampling import collect_groups
from llamarl.rewards.scorer import RewardScorer, ScoredGroup
from llamarl.rollout.source import RolloutSource, SourceContext, build_source
from llamarl.runtime.cores import local_ranks, threads_for
from llamarl.runtime.gpus import node_gpus
from llamarl.runtime.roster import Roster, started_key
from llamarl.runtime.setup import STARTUP_TIMEOUT_S, Runtime, free_port, log
from llamarl.timeline import Timeline


def engine_world(rt: Runtime) -> EngineWorld | None:
    """The private world of this rank's engine (None for tp 1): its leader picks the port and
    publishes it; the other tp ranks read it. An engine's tp ranks share a node (checked by
    the layout), so loopback reaches the leader. A replacement's world is its own."""
    if rt.layout.tp == 1:
        return None
    key = f"engine/{rt.role.index}{_incarnation(rt)}/port"
    if rt.role.is_engine_leader:
        rt.store.set(key, str(free_port()))
    port = int(rt.wait_key(key))
    # vLLM's local rank is the device index in what this process sees (runtime/gpus.py: the
    # engine's GPUs, or the one GPU of a Slurm task), not the node's local rank
    local_rank = rt.env.local_rank if rt.on_cpu else rt.device.index
    peers_visible = rt.on_cpu or len(node_gpus(os.environ)) >= rt.layout.tp
    return EngineWorld(rt.role.tp_rank, rt.layout.tp, "127.0.0.1", port, local_rank,
                       cpu_shm_prefix(rt.run_id, port), peers_visible)


def engine_commands(rt: Runtime) -> EngineCommands:
    """The command stream of this rank's tp > 1 engine (generator/tp.py); built by all its
    tp ranks at once."""
    group = plan_for(rt).command_group(rt.role.index, rt.joining)
    return EngineCommands(planned_spec(rt, group), rt.store)


def _incarnation(rt: Runtime) -> str:
    """The part of a tp > 1 engine's key names that tells a replacement (launch/join.py)
    from the engine it replaces."""
    return f".{rt.joining}" if rt.joining else ""


def check_lengths(prompts, max_new_tokens: int, max_model_len: int) -> None:
    """Start-up check: every prompt plus a full response must fit the engine's context."""
    longest = max(len(p.token_ids) for p in prompts)
    if longest + max_new_tokens > max_model_len:
        raise ValueError(
            f"generator.max_model_len {max_model_len} is below the longest prompt ({longest} "
            f"tokens) plus generator.max_new_tokens ({max_new_tokens}): raise max_model_len to "
            f"at least {longest + max_new_tokens} or shorten the responses")


def read_prompt_data(rt: Runtime) -> PromptData:
    """Every engine reads the same data (before its engine starts, so a bad file fails fast);
    engine 0 logs what was read and the malformed rows skipped."""
    data = load_prompt_data(rt.cfg.data, rt.cfg.run.seed)
    if rt.role.index == 0 and rt.role.is_engine_leader:
        for line in data.notes:
            log(rt, line)
    return data


def largest_call(rt: Runtime, held_out: int) -> int:
    """Sequences of this engine's largest generate call: a training batch (continuous mode:
    the sequences kept running), or the held-out evaluation (its share of the held-out
    prompts x eval_samples_per_prompt)."""
    cfg, engines = rt.cfg, rt.layout.engines
    train = -(-cfg.generator.prompts_per_step // engines) * cfg.generator.samples_per_prompt
    if cfg.generator.mode == "continuous":  # sequences kept running (an evaluation pauses them)
        train = cfg.generator.in_flight_sequences or train
    evaluation = -(-held_out // engines) * cfg.data.eval_samples_per_prompt
    return max(train, evaluation)


def join_weight_groups(rt: Runtime, engine: Engine) -> int:
    """Open the engine's end of the weight sync (the plan's groups, parallel/plan.py: torch
    transport, wsync<r> = [trainer r (group rank 0), generator ranks (1 + j)] for every
    trainer rank r, or trainer 0 alone under sync.senders one, see parallel.weight_sync.
    open_sender); returns the first sync it receives: 0."""
    engine.join_weight_sync(engine_transport(rt), sender_metas(rt),
                            rt.cfg.sync.bucket_mb, rt.cfg.sync.solo_mb, synced_adapter(rt.cfg),
                            rt.cfg.sync.receive_buffers, allocated_later(rt))
    return 0


def allocated_later(rt: Runtime) -> dict[str, int]:
    """What this generator rank allocates on its GPU after the engine's memory check
    (gpu_memory.later_bytes): the NCCL communicators of the groups it joins (the job's plan,
    gpu_communicators), and on the engine leader a
    generator-placed reward model. Nothing on the CPU."""
    if rt.device.type != "cuda":
        return {}
    plan = plan_for(rt)
    groups = plan.gpu_communicators(rt.env.rank)  # (rollout pairs, commands: gloo)
    reward = rt.cfg.reward
    model = (reward_model_bytes(reward.model_path) if reward.model_path and
             reward.model_placement == "generator" and rt.role.is_engine_leader else 0)
    return later_bytes(len(groups), model)


def synced_adapter(cfg) -> dict | None:
    """The adapter config the weight syncs bring (model.lora.sync adapters), else None."""
    return adapter_config(cfg.model.lora) if adapter_sync(cfg) else None


def join_as_replacement(rt: Runtime, engine: Engine) -> int:
    """A replacement engine (launch/join.py) asks the trainers for its weights; trainer 0
    picks the sync they start with (parallel/weight_members.py), and each tp rank of this
    engine builds a group with each sender for it, [trainer r, its tp ranks] (the
    filesystem transport: reads the files of that sync on). Returns that sync's number.

    With tp > 1 the syncs it receives are resharded from the first (the senders are past
    their first sync): each tp rank reads what the engine's tp rank of its number read on
    the job's first sync (`wsync/needs/<receiver>`, weight_receiver)."""
    e, n = rt.role.index, rt.joining
    tp, k = rt.layout.tp, rt.role.tp_rank
    if k:  # tp rank 0 asks once every tp rank is up (the trainers then wait for them all)
        rt.store.set(f"join/{e}/{n}/up/{k}", "1")
    else:
        for j in range(1, tp):
            rt.wait_key(f"join/{e}/{n}/up/{j}")
        log(rt, f"replacement {n} asks the trainers for engine {e}'s weights")
        rt.store.set(f"join/{e}", n)
        Roster(rt.store, rt.layout.engines).note_change()  # the trainers look again
    first = int(rt.wait_key(f"join/{e}/{n}/sync"))
    options = {}
    if tp > 1 and reshards(rt.cfg):  # receiver 1 + k: tp rank k of engine 0
        options["needs"] = rt.wait_key(f"wsync/needs/{1 + k}")
    spec = replacement_transport(rt, n, first, options)
    engine.join_weight_sync(spec, sender_metas(rt),
                            rt.cfg.sync.bucket_mb, rt.cfg.sync.solo_mb, synced_adapter(rt.cfg),
                            rt.cfg.sync.receive_buffers, allocated_later(rt))
    return first


def rejoin(rt: Runtime, weights: WeightFollower, first_sync: int) -> None:
    """A replacement: load the weights of sync `first_sync`, then rejoin the roster (its own
    slot comes back from the engine that made it meanwhile, generator/slots.py)."""
    weights.received = first_sync
    version = int(rt.wait_key(f"wsync/version/{first_sync}"))
    weights.resumed_at(version)  # evaluations resume at the next eval point
    weights.load_first()  # (its engine holds placeholder weights until then)
    if weights.follow(need=version):
        ranks = rt.layout.engine_global_ranks(rt.role.index)
        if Roster(rt.store, rt.layout.engines).rejoin(rt.role.index, ranks) is None:
            rt.watchdog.leave("this replacement was declared lost before it was back (a rank "
                              "of it found dead)", "it leaves (the job goes on as it did)")
        rt.back = True
        log(rt, f"replacement engine {rt.role.index} has the weights of version {version}: "
                f"back in the job")


def model_wait_s(cfg) -> float:
    """How long a generator waits for the trainers to publish the model's path: the start-up
    limit, plus a teacher's build where the trainers may have to build it first
    (llamarl/models/recipe_teacher.py)."""
    if cfg.algorithm.teacher_path not in RECIPE_TEACHERS:
        return STARTUP_TIMEOUT_S
    from llamarl.models.recipe_teacher import BUILD_TIMEOUT_S

    return STARTUP_TIMEOUT_S + BUILD_TIMEOUT_S


def run_generator(rt: Runtime) -> None:
    cfg = rt.cfg
    data = read_prompt_data(rt)
    t0 = time.perf_counter()
    threads = threads_for(cfg, rt.layout, rt.role.rank) if rt.on_cpu else 0
    world = engine_world(rt)
    # vLLM's import (~10 s of CPU) runs while the trainers build or load the model, not after
    import_vllm(world, rt.on_cpu)
    t_wait = time.perf_counter()
    model_path = rt.wait_key("model/path", model_wait_s(cfg))
    t0 += time.perf_counter() - t_wait  # ("engine up in": without the wait for the model)
    if world is None or not rt.on_cpu:
        return run_engine(rt, data, model_path, threads, t0, world)
    # tp > 1 on CPU: vLLM's all-reduce segments (generator/cpu_fixes.py) go however this rank
    # ends: here, or from the watchdog when it leaves the job or fails it
    shm_cleanup = functools.partial(unlink_cpu_shm, world.shm_prefix)
    rt.watchdog.local_cleanups.append(shm_cleanup)
    try:
        run_engine(rt, data, model_path, threads, t0, world)
    finally:
        shm_cleanup()


def run_engine(rt: Runtime, data: PromptData, model_path: str, threads: int, t0: float,
               world: EngineWorld | None) -> None:
    """Start this rank's share of its engine, join the weight groups, and run the loop (the
    leader) or follow the leader's engine calls (its other tp ranks)."""
    cfg, g, e = rt.cfg, rt.cfg.generator, rt.role.index
    leader = rt.role.is_engine_leader
    # Placeholder weights (vLLM's dummy load): the engine reads none of the checkpoint's
    # tensors, and takes its first weights from the trainers (WeightFollower.load_first,
    # before it generates or evaluates anything), so it samples from exactly the trainer's
    # policy even where vLLM would read the checkpoint otherwise than transformers does.
    # Adapter-only syncs (model.lora.sync adapters) never send the base weights: the engine
    # reads them from the checkpoint, as the trainers do, and runs vLLM's LoRA layers.
    adapters = adapter_sync(cfg)
    engine = Engine(model_path, g, cfg.model.dtype, seed=cfg.run.seed + e, on_cpu=rt.on_cpu,
                    world=world, sequences=largest_call(rt, len(data.held_out)),
                    engines_on_host=local_ranks(rt.layout, rt.role.rank, "generator"),
                    threads=threads, load_format="auto" if adapters else "dummy",
                    lora_rank=cfg.model.lora.rank if adapters else 0)
    log(rt, f"vLLM engine up in {time.perf_counter() - t0:.1f} s ({model_path}"
            + (f", {threads} threads" if threads else "") + ")")
    if leader and engine.kv is not None:
        log(rt, engine.kv.describe())

    first_sync = join_as_replacement(rt, engine) if rt.joining else join_weight_groups(rt, engine)
    if not leader:  # its groups with the trainers are built (the leader's: in lead)
        rt.store.set(started_key(rt.role.rank), "1")
    if rt.layout.tp == 1:
        return lead(rt, engine, data, model_path, first_sync)
    # tp > 1 (generator/tp.py): the leader runs the loop, its tp ranks make its engine calls
    commands = engine_commands(rt)
    if not leader:
        n = follow_leader(engine, commands)
        log(rt, f"followed {n} engine commands of the leader of engine {e}")
        return
    engine.commands = commands
    lead(rt, engine, data, model_path, first_sync)
    commands.stop()  # only when the loop ended well: a failed leader fails the job


def lead(rt: Runtime, engine: Engine, data: PromptData, model_path: str,
         first_sync: int) -> None:
    """The loop of the module docstring, on the engine's leader (its only rank for tp 1)."""
    cfg, g, e = rt.cfg, rt.cfg.generator, rt.role.index
    fmt = PromptFormatter(engine.tokenizer, cfg.data.chat_template, cfg.data.system_prompt,
                          model_path)
    k, b = cfg.sync.max_staleness, rt.resume.get("step", 0)
    survives = plan_for(rt).survives_engine_loss
    slots = SlotSet(rt, data, fmt, b, keep_states=survives, own=not rt.joining,
                    check=lambda prompts: check_lengths(prompts, g.max_new_tokens,
                                                        g.max_model_len))
    # every group this engine shares with the trainers is built (weights above, the rollout
    # channels of its slot here): lost from now on, the job can go on without it
    rt.store.set(started_key(rt.role.rank), "1")
    scorer = RewardScorer(cfg.reward, g.max_new_tokens, str(rt.device))
    rt.watchdog.local_cleanups.append(scorer.close)
    if cfg.reward.model_path and scorer.model is None and e == 0:
        log(rt, "the reward model scores on the trainer ranks (reward.model_placement="
                "trainer): eval.jsonl holds the reward functions' held-out reward only")
    timeline = Timeline(rt.run_dir, rt.role.rank, rt.role.name)
    source_ctx = SourceContext(cfg, engine, engine.tokenizer, fmt, scorer, e, timeline)
    source = build_source(source_ctx)
    rt.watchdog.local_cleanups.append(source.close)
    evaluator = Evaluator(rt, source, slots.held_out)
    evaluator.timeline = timeline
    weights = WeightFollower(rt, engine, evaluator, timeline)
    if rt.joining:  # from the sync the trainers send this replacement first, then its slot
        rejoin(rt, weights, first_sync)
    elif b:  # resuming: the slots continue the prompt order right after the last batch trained
        weights.resumed_at(b)
        weights.load_first()  # the restored policy (version b)
    else:
        weights.load_first()  # the trainer's starting weights (version 0)
        evaluator.run(step=0, version=0)
    prefer_fresh = cfg.sync.prefer_fresh and k >= 2 and not cfg.sync.deterministic

    try:
        if g.mode == "continuous":  # generator/continuous.py: the engine never drains
            # episodes (multi_turn, agent) get environment workers of their own, apart from
            # the evaluation's (it runs while they are paused and must not read their results)
            episodes = build_source(source_ctx) if source.episodic else None
            if episodes is not None:
                rt.watchdog.local_cleanups.append(episodes.close)
            try:
                run_continuous(rt, engine, scorer, episodes, slots, weights, timeline,
                               _to_batch, data.bad_row_count)
            finally:
                if episodes is not None:
                    episodes.close()
        while g.mode == "batch":
            slots.refresh()  # slots taken over from a lost engine, or handed back
            if not slots.ready():  # a replacement whose slot is not handed back yet
                if weights.follow(need=1 << 62, interrupt=slots.changed) is False:
                    break
                continue
            slot = slots.next()
            b = slot.next_batch
            ready = weights.follow(need=b - k, queued=slots.queued, exact=cfg.sync.deterministic,
                                   prefer=fresh_version(b, k, cfg.sync.every) if prefer_fresh
                                   else None, interrupt=slots.changed)
            if ready is None:
                continue  # the slots changed while waiting: the next batch may be another's
            if not ready:
                break
            batch = sample_batch(rt, source, slot.loader.next, weights.version, b, slot.index)
            # the loader's position right after this batch (dynamic sampling draws a varying
            # number of prompts per batch)
            batch.info.update(engine=slot.index, made_by=e, data_state=slot.loader.state_dict(),
                              data_epoch=slot.loader.epoch, data_bad_rows=data.bad_row_count,
                              prev_put_s=slots.last_put_s())
            with timeline.phase("put", b):
                slots.put(slot, batch, abort=weights.trainer_done)
        weights.finish()
    except BaseException as e:
        if not isinstance(e, KeyboardInterrupt):  # its engine lost and the job going on: the
            rt.watchdog.leave_if_mate_lost()  # batches it published are still the trainers'
        slots.close()  # failing: unlink what is in flight at once
        raise
    finally:
        source.close()
        scorer.close()
    extra = slots.close()  # batches made ahead after the last step
    if extra:
        log(rt, f"{extra} rollout batch(es) generated ahead of the last trainer step were "
                "not needed and were discarded")


def sample_batch(rt: Runtime, source: RolloutSource, draw, version: int,
                 step: int, e: int) -> RolloutBatch:
    """Rollout batch `step` of slot `e` (runtime/roster.py: engine e's unless it was lost):
    its share of the step's groups (parallel/shares.py) drawn with `draw(n)`, generated by policy
    `version` (several rounds with dynamic sampling)."""
    cfg, g = rt.cfg, rt.cfg.generator
    shares = plan_for(rt).shares  # slot e's share of the step's groups (parallel/shares.py)
    per_engine = shares.groups_of_engine(e)
    metrics: dict[str, float] = {}

    def sample(prompts, round_: int, first: int) -> list[ScoredGroup]:
        got = source.collect(prompts, g.samples_per_prompt, g.temperature,
                             sampler_seed(cfg.run.seed, "train", step, e, round_), version,
                             step=step, first=first)
        for k, v in got.metrics.items():  # every round counts, kept or dropped
            metrics[k] = metrics.get(k, 0.0) + v
        return got.groups

    groups, ds = collect_groups(draw, sample, per_engine, g.dynamic_sampling,
                                g.max_sampling_rounds)
    if cfg.run.samples_per_step and e == 0:  # a few for a person to read (generator/samples.py)
        append_rows(rt.run_dir / "samples" / "train.jsonl",
                    sample_rows(groups, source.ctx.tokenizer, step + 1, "train",
                                cfg.run.samples_per_step))
    rounds = g.max_sampling_rounds if g.dynamic_sampling else 1
    batch = _to_batch(groups, e, step, shares.most_of_an_engine * rounds)
    n = len(batch)
    names = groups[0].components.keys()
    if "episodes" in metrics:  # multi-turn: observation and glue tokens after the prompt
        metrics.update(episode_counts(batch))
    info = {"step": step, "generate_s": metrics.pop("generate_s", 0.0),
            "reward_s": metrics.pop("reward_s", 0.0),
            "reward_errors": int(metrics.pop("reward_errors", 0)),
            "reward_timeouts": int(metrics.pop("reward_timeouts", 0)),
            "rollout": metrics, "tokens": int(batch.loss_mask.sum()),
            "reward_components": {name: sum(sum(grp.components[name]) for grp in groups) / n
                                  for name in names}}
    info.update(ds)
    batch.info.update(info)
    return batch


def _to_batch(groups: list[ScoredGroup], engine: int, step: int, stride: int) -> RolloutBatch:
    """`stride` bounds the prompts drawn per batch (the largest slot share x rounds), so
    group ids are unique across engines, steps and sampling rounds."""
    samples, rewards, gids = [], [], []
    for grp in groups:
        gid = (step * 65_536 + engine) * stride + grp.index
        samples += grp.samples
        rewards += grp.rewards
        gids += [gid] * len(grp.samples)
    return RolloutBatch.from_samples(samples, rewards, gids, engine)
