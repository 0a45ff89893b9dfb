"""The trainer role: FSDP2 policy (and PPO's critic, the reference) on the trainer sub-mesh,
RL updates, weight broadcast.

On-policy loop of trainer rank r (of T), with E engines:

    for step in 0..steps-1:
        batch = concat(channel[e -> r].get() for e in engines)      # whole groups, version = step
        reward.model_placement = trainer: batch.rewards += w_rm * RM(batch), the reward model
            FSDP2-sharded like the reference                          (trainer/reward_model.py)
        policy_step(batch): advantages (GRPO, RLOO, ..., PPO's GAE with the critic, the
            teacher's per-token reverse KL: trainer/teacher.py), then
            algorithm.epochs x algorithm.mini_batches optimizer steps     (trainer/rl_step.py)
        WeightSender.publish(model)              # every rank sends its own shards
    save the final policy as a Hugging Face directory
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import resource
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from llamarl.buffer.channels import open_channel
from llamarl.buffer.record import RolloutBatch
from llamarl.parallel.plan import plan_for
from llamarl.parallel.weight_sync import open_sender
from llamarl.registry.algorithms import ALGORITHMS
from llamarl.rewards.scorer import reward_metrics
from llamarl.rollout.source import rollout_metrics
from llamarl.runtime.cores import threads_for
from llamarl.runtime.roster import Roster
from llamarl.runtime.setup import Runtime, log
from llamarl.timeline import Timeline
from llamarl.trainer import checkpoint
from llamarl.trainer.critic import build_critic
from llamarl.trainer.lora import (
    AdaptersOff,
    add_adapters,
    has_adapters,
    merged_state_dict,
    store_frozen_in,
    trainable_count,
)
from llamarl.trainer.metrics import MetricsLog, MismatchWatch
from llamarl.trainer.policy import DTYPES, load_frozen, load_policy, shard_for_training
from llamarl.trainer.reward_model import build_reward_model
from llamarl.trainer.rl_step import policy_step
from llamarl.trainer.step import PolicyTrainer
from llamarl.trainer.stop import StopRequest
from llamarl.trainer.teacher import load_teacher, resolve_teacher_path

TRAINER_BACKEND = {"cuda": "cpu:gloo,cuda:nccl", "cpu": "gloo"}


def resident_mib() -> float:
    """This process's resident memory now (VmRSS), MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def init_trainer_group(rt: Runtime):
    """The trainer sub-mesh: a role-local default group (trainer ranks only) and its mesh."""
    if rt.on_cpu:
        torch.set_num_threads(threads_for(rt.cfg, rt.layout, rt.role.rank))
    else:
        torch.cuda.set_device(rt.device)
    # On GPU, NCCL carries the CUDA tensors (FSDP2) and gloo the small CPU tensors (batch
    # statistics, advantage normalisers, checkpoint metadata): NCCL alone rejects CPU tensors.
    backend = TRAINER_BACKEND[rt.device.type]
    dist.init_process_group(backend, store=dist.PrefixStore("trainer", rt.store),
                            rank=rt.role.index, world_size=rt.layout.trainer_ranks,
                            timeout=timedelta(seconds=rt.cfg.sync.timeout_s))
    return init_device_mesh(rt.device.type, (rt.layout.trainer_ranks,))


def load_reference(cfg, model_path: str, mesh, device: torch.device,
                   policy: torch.nn.Module | None = None):
    """The frozen reference policy (the starting checkpoint), FSDP2-sharded on the trainer
    mesh like the policy; None when algorithm.kl_coef is 0 (nothing is loaded). A LoRA
    policy (model.lora) is its own reference: the same module with its adapters off
    (lora.AdaptersOff), no second copy of the weights."""
    if cfg.algorithm.kl_coef == 0:
        return None
    if cfg.model.lora.rank:
        assert policy is not None and has_adapters(policy), "a LoRA run passes its policy"
        return AdaptersOff(policy)
    return load_frozen(model_path, cfg, mesh, device)


def write_run_files(rt: Runtime, model_path: str, recipe: bool = True) -> None:
    """The run directory's model.json and recipe.yaml (what this run trains, as launched)."""
    from llamarl.config import config_to_yaml

    if recipe:
        (rt.run_dir / "recipe.yaml").write_text(config_to_yaml(rt.cfg))
    (rt.run_dir / "model.json").write_text(json.dumps({"spec": rt.cfg.model.path,
                                                        "path": model_path}))


def check_tokenizer(tokenizer, model_path: str) -> None:
    """Start-up check: RL needs completions that can end and batches that can be padded."""
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer of {model_path} has no EOS token, so no completion "
                         "could ever finish: set eos_token in its tokenizer_config.json")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out; any id works


def resolve_model_path(rt: Runtime, mesh) -> str:
    """The policy's HF directory; builds the embedded tiny model's warm start when needed."""
    spec = rt.cfg.model.path
    if spec.startswith("tiny:"):
        from llamarl.models.tiny import warm_start_dir
        from llamarl.trainer.warmstart import run_warm_start

        path = warm_start_dir(spec.split(":", 1)[1])
        if not (path / "config.json").is_file():
            log(rt, f"building the tiny model's warm start (cached at {path})")
            run_warm_start(spec.split(":", 1)[1], path, mesh, rt.device,
                           log=lambda m: log(rt, m) if rt.role.index == 0 else None)
        return str(path)
    if spec.startswith("smollm2:"):  # fetched and converted once, then cached (all ranks
        # wait for trainer 0, which does it)
        from llamarl.models.smollm2 import ensure_smollm2, model_dir

        variant = spec.split(":", 1)[1]
        if rt.role.index == 0:
            path = ensure_smollm2(variant, log=lambda m: log(rt, m))
        dist.barrier()
        return str(path if rt.role.index == 0 else model_dir(variant))
    if not (Path(spec) / "config.json").is_file():
        raise ValueError(f"model.path {spec!r} is not a Hugging Face model directory (no "
                         "config.json): point it at a local checkpoint, or use tiny:reverse "
                         "or smollm2:135m-instruct")
    return spec


def run_trainer(rt: Runtime) -> None:
    cfg, r, T = rt.cfg, rt.role.index, rt.layout.trainer_ranks
    mesh = init_trainer_group(rt)
    model_path = resolve_model_path(rt, mesh)
    teacher_path = resolve_teacher_path(cfg.algorithm.teacher_path, r,
                                        log=lambda m: log(rt, m) if r == 0 else None)
    if r == 0:
        rt.store.set("model/path", model_path)
    if r == 0 and not rt.resume:
        write_run_files(rt, model_path, recipe=False)  # setup wrote recipe.yaml
    model = load_policy(model_path, cfg.trainer.master_dtype,
                        cfg.model.attn_implementation).to(rt.device)
    if cfg.model.lora.rank:  # before sharding: adapters are sharded like every parameter
        add_adapters(model, cfg.model.lora, cfg.run.seed)
        trained, total = trainable_count(model)
        saved = store_frozen_in(model, DTYPES[cfg.model.dtype])
        log(rt, f"LoRA rank {cfg.model.lora.rank} on {', '.join(cfg.model.lora.target_modules)}"
                f": {trained} of {total} parameters trained ({100 * trained / total:.2f}%), "
                f"the frozen base kept in {cfg.model.dtype}"
                + (f" ({saved / 2**20:.0f} MiB less)" if saved else ""))
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    check_tokenizer(tokenizer, model_path)
    shard_for_training(model, mesh, cfg.trainer, DTYPES[cfg.model.dtype])
    opt_steps = cfg.run.steps * cfg.algorithm.epochs * cfg.algorithm.mini_batches
    trainer = PolicyTrainer(model, cfg.trainer, opt_steps, T, rt.device,
                            cfg.generator.temperature, cfg.algorithm.entropy_coef > 0)
    reference = load_reference(cfg, model_path, mesh, rt.device, policy=model)
    teacher = load_teacher(cfg, teacher_path, tokenizer, model_path, mesh, rt.device)
    if teacher is not None:
        log(rt, f"teacher {teacher_path} sharded over {T} trainer rank(s)")
    critic = (build_critic(cfg, model_path, mesh, rt.device, opt_steps, T)
              if ALGORITHMS[cfg.algorithm.name].critic else None)
    reward_model = build_reward_model(cfg, tokenizer, mesh, rt.device)
    if reward_model is not None:
        log(rt, f"reward model {cfg.reward.model_path} sharded over {T} trainer rank(s)")

    sender = open_sender(rt, model)
    sender.guard(trainer.opt)  # large shards are sent straight from the parameters
    channels = [open_channel(rt, e, r, "consumer") for e in range(rt.layout.engines)]
    log(rt, "rollout channels: " + ", ".join(f"{ch.channel} over {ch.transport}"
                                             for ch in channels))
    metrics = (MetricsLog(rt.run_dir / "metrics.jsonl", kl_ref=reference is not None,
                          resumed_at=rt.resume.get("step")) if r == 0 else None)
    mismatch = MismatchWatch(cfg.sync.mismatch_warn)
    log(rt, f"policy {model_path} sharded over {T} trainer rank(s); "
            f"sends {sender.bytes_per_sync / 2**20:.2f} MiB of shards per weight sync in "
            f"{len(sender.buckets)} bucket(s), {sum(sender.direct)} of them straight from the "
            "parameters")

    timeline = Timeline(rt.run_dir, rt.role.rank, rt.role.name)
    roster = (Roster(rt.store, rt.layout.engines)
              if r == 0 and plan_for(rt).survives_engine_loss else None)
    version, dropped_total, k = 0, 0, cfg.sync.max_staleness
    resume = rt.resume
    # Per engine, the prompt loader's state after the last batch trained on (saved in every
    # checkpoint, restored by the generators on resume).
    data_state: dict[str, dict] = dict(resume.get("data_state", {})) if resume else {}
    if resume:
        meta = checkpoint.load(Path(resume["checkpoint"]), model, trainer.opt, trainer.sched,
                               critic)
        version = meta["policy_version"]  # (below run.steps: runtime/setup.py checked)
        log(rt, f"resumed from {resume['checkpoint']} at step {meta['step']}")
        if r == 0:  # only now: a resume that fails leaves the run's files as they were
            write_run_files(rt, model_path)
    # a LoRA checkpoint holds the adapters only: export needs their config
    lora_meta = ({"lora": dataclasses.asdict(cfg.model.lora)} if cfg.model.lora.rank else {})
    # The engines start with placeholder weights (vLLM's dummy load, generator/loop.py) and
    # take their first ones from here, new run or resumed: they sample from exactly the
    # trainer's policy whatever vLLM would have read from disk (a checkpoint with tied
    # embeddings stored as lm_head.weight alone loads in transformers, not in vLLM).
    sender.publish(model, version)
    run_t0 = time.perf_counter()
    # step_time_s is the period from one step's row to the next: the parts below plus the
    # trainer's own work between them (writing the row, logging, TensorBoard), so that the
    # step times sum to the run's wall-clock time, as a peer's per-step clock reads it
    t_row = run_t0
    stop = StopRequest(rt.store, rt.run_dir, r)
    for step in range(version, cfg.run.steps):
        t_step = time.perf_counter()
        waits = [ch.wait_s for ch in channels]
        with timeline.phase("wait_rollouts", step):
            parts = [ch.get() for ch in channels]
        wait_s = sum(ch.wait_s for ch in channels) - sum(waits)
        transfer_s = time.perf_counter() - t_step - wait_s
        batch, dropped = drop_stale(RolloutBatch.concat(parts), version, k)
        info = [p.info for p in parts]
        data_state.update((str(i["engine"]), i["data_state"]) for i in info)
        rm_row = {}
        if reward_model is not None:  # every rank, even with batch None: FSDP2 collectives
            with timeline.phase("reward_model", step):
                rm_row = reward_model.add_scores(batch, cfg.reward.model_weight,
                                                 cfg.trainer.micro_batch_size)

        t0 = time.perf_counter()
        with timeline.phase("train", step):
            stats = policy_step(trainer, batch, cfg, tokenizer.pad_token_id, version, dropped,
                                reference, critic, teacher)
        train_s = time.perf_counter() - t0
        dropped_total += int(stats["dropped"])

        t0 = time.perf_counter()
        version += 1
        last = step + 1 == cfg.run.steps or stop.ends_at(version)  # (RUN_DIR/stop)
        if last and version < cfg.run.steps and r == 0:
            log(rt, f"stopping at step {version} of {cfg.run.steps}: {stop.path} asked for it "
                    "(run.resume=auto continues the run)")
        if last and r == 0:
            rt.store.set("trainer/final_version", str(version))  # generators stop after it
        if last or version % cfg.sync.every == 0:
            with timeline.phase("sync", step):
                sender.publish(model, version)  # pack now, broadcast in the background
        sync_s = time.perf_counter() - t0
        every = cfg.run.checkpoint_every
        t0, checkpointed = time.perf_counter(), False
        if every and (version % every == 0 or last):
            checkpointed = True
            with timeline.phase("checkpoint", step):
                checkpoint.save(rt.run_dir, version, model, trainer.opt, trainer.sched, keep=
                                cfg.run.keep_checkpoints, critic=critic, meta={
                                    "policy_version": version, "model_path": model_path,
                                    "dtype": cfg.model.dtype,
                                    "data_state": data_state, **lora_meta})
        checkpoint_s = time.perf_counter() - t0 if checkpointed else 0.0

        by_engine = {int(p.generator[0]): int(p.policy_version.min()) for p in parts if len(p)}
        n_tok = max(stats["n_tokens"], 1.0)
        row = {
            "step": step + 1, "policy_version": version,
            "reward_mean": stats["reward_sum"] / max(stats["n_seqs"], 1.0),
            # samples whose group's rewards are all equal: no signal under a group baseline
            "equal_reward_share": stats["equal_reward_seqs"] / max(stats["n_seqs"], 1.0),
            "loss": stats["loss"], "grad_norm": stats["grad_norm"], "lr": stats["lr"],
            "clip_frac": stats.get("corrected", 0.0) / n_tok,
            "mismatch_kl": stats.get("mismatch_kl", 0.0) / n_tok,
            "entropy": stats.get("entropy_sum", 0.0) / n_tok,
            "kl_ref": stats.get("kl_ref", 0.0) / n_tok,
            "ratio_mean": stats.get("ratio_sum", 0.0) / n_tok,
            "ratio_max": stats.get("ratio_max", 0.0), "ratio_min": stats.get("ratio_min", 0.0),
            "staleness_mean": stats["staleness_sum"] / max(stats["n_seqs"], 1.0),
            "staleness_max": stats["staleness_max"],
            "dropped_stale": int(stats["dropped"]), "dropped_stale_total": dropped_total,
            "batch_digest": hashlib.sha1(batch.token_ids.numpy().tobytes()).hexdigest()[:12]
            if batch is not None else "",
            "behaviour_version_by_engine": by_engine,
            "response_len": stats["n_tokens"] / max(stats["n_seqs"], 1.0),
            "finished_frac": stats["finished"] / max(stats["n_seqs"], 1.0),
            "tokens_generated": int(stats["n_tokens"]),
            "data_bad_rows": max(i["data_bad_rows"] for i in info),
            "data_epoch": max(i["data_epoch"] for i in info),
            "generate_s": max(i["generate_s"] for i in info),
            "reward_s": max(i["reward_s"] for i in info),
            "wait_s": wait_s, "transfer_s": transfer_s, "train_s": train_s, "sync_s": sync_s,
            "checkpoint_s": checkpoint_s,
            "train_tokens_per_s": stats["n_tokens_all"] / max(train_s, 1e-9),
            # the share of the update's forward tokens that are padding (0 when packed)
            "padding_share": stats["padding_share"],
            # the share of its micro-batches that ran with shared prompts (trainer.share_prompts)
            "shared_prompts": stats["shared_prompts"],
            # buffer cost: this rank's reads + the producers' writes (of the previous batch)
            "buffer_s": transfer_s + sum(i.get("prev_put_s", 0.0) for i in info),
            "broadcast_s": sender.last_broadcast_s,
            # what this trainer rank sends per weight sync, and its peak resident memory so far
            # (Linux's ru_maxrss is in KiB)
            "sync_mib": sender.bytes_per_sync / 2**20,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_mib": resident_mib(),  # now: a leak shows as growth from step to step
        }
        now = time.perf_counter()
        period = now - t_row
        # what the parts leave out: the trainer's bookkeeping (the last row's metrics and
        # log line, this one's statistics, the batch's assembly)
        other_s = period - (wait_s + transfer_s + train_s + sync_s + checkpoint_s
                            + rm_row.get("reward_model_s", 0.0))
        row.update(step_time_s=period, other_s=other_s, elapsed_s=now - run_t0)
        t_row = now
        if teacher is not None:  # the per-token reverse KL to the teacher (algorithms/distill)
            row["kl_teacher"] = stats["kl_teacher"] / n_tok
        if critic is not None:
            row.update(value_loss=stats["value_loss"], critic_grad_norm=stats["critic_grad_norm"],
                       value_mean=stats["value_sum"] / n_tok,
                       value_clip_frac=stats["value_clipped"] / n_tok)
        row.update(reward_metrics(info))  # reward errors/timeouts, dynamic sampling, components
        row.update(rollout_metrics(info))  # multi-turn: turns, tool calls, errors, env time
        row.update(rm_row)  # reward/reward_model, reward_model_s (trainer placement)
        if roster is not None:  # engines alive (runtime/roster.py): fewer after a loss
            row["engines_live"] = len(roster.read().live)
        row["skipped_steps_total"] = int(stats["skipped_total"])
        if "skipped" in stats:
            row["skipped_step"] = 1
        if metrics is not None:
            metrics.write(row)
            if (step + 1) % cfg.run.log_every == 0 or last:
                log(rt, metrics.line(row, cfg.run.steps))
            alarm = mismatch.check(row)
            if alarm is not None:
                log(rt, alarm)
        if last:
            break

    sender.wait()
    final_dir = rt.run_dir / "policy"
    save_policy(model, model_path, final_dir, r == 0, DTYPES[cfg.model.dtype])
    if r == 0:
        summarize(rt, final_dir, version)


def drop_stale(batch: RolloutBatch, version: int, max_staleness: int):
    """Keep samples at most `max_staleness` versions older than `version`. Returns the kept
    batch (or None if nothing is left) and the dropped one (or None)."""
    fresh = (version - batch.policy_version) <= max_staleness
    if bool(fresh.all()):
        return batch, None
    keep = fresh.nonzero().flatten()
    return (batch.select(keep) if len(keep) else None), batch.select((~fresh).nonzero().flatten())


def save_policy(model: torch.nn.Module, src_dir: str, out_dir: Path, writer: bool,
                dtype: torch.dtype) -> None:
    """Gather the full weights (collective) and write a HF directory loadable by transformers
    and vLLM (safetensors + config + tokenizer), in the compute dtype `dtype`; a LoRA
    policy's with its adapters merged (W + s B A)."""
    from transformers import AutoConfig, AutoTokenizer

    from llamarl.tiny.model import save_hf_dir

    full = (merged_state_dict(model) if has_adapters(model) else
            {k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
             for k, v in model.state_dict().items()})
    state = {k: v.detach().cpu().to(dtype) for k, v in full.items()}
    if writer:
        config = AutoConfig.from_pretrained(src_dir)
        config.dtype = dtype
        save_hf_dir(out_dir, state, config, AutoTokenizer.from_pretrained(src_dir))
    dist.barrier()


def summarize(rt: Runtime, final_dir: Path, version: int) -> None:
    after = json.loads(rt.wait_key(f"eval/result/{version}"))
    before = json.loads((rt.run_dir / "eval.jsonl").read_text().splitlines()[0])
    r = rt.cfg.reward
    what = " of the reward functions" if r.model_path and r.model_placement == "trainer" else ""
    log(rt, f"held-out reward{what} (sampled, T={rt.cfg.generator.temperature}): "
            f"before {before['reward_mean']:.3f} -> after {after['reward_mean']:.3f} "
            f"(greedy {before['reward_mean_greedy']:.3f} -> {after['reward_mean_greedy']:.3f})")
    log(rt, f"final policy: {final_dir}")
    print(f"run directory: {rt.run_dir}", flush=True)
