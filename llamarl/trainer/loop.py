"""The trainer role: FSDP2 policy (and PPO's critic, the reference) on the trainer sub-mesh,
RL updates, weight broadcast.

On-policy loop of trainer rank r (of T), with E engines (run_trainer reads as this list):

    models = build_parts()       policy, optimizer, tokenizer, and the reference, teacher,
                                 critic and reward model the recipe uses   (trainer/parts.py)
    for step in 0..steps-1:
        batch = concat(channel[e -> r].get() for e in engines)      # whole groups, version = step
                                                                     (trainer/rollouts.py)
        reward.model_placement = trainer: batch.rewards += w_rm * RM(batch), the reward model
            FSDP2-sharded like the reference                          (trainer/reward_model.py)
        policy_step(batch): advantages (GRPO, RLOO, ..., PPO's GAE with the critic, the
            teacher's per-token reverse KL: trainer/teacher.py), then
            algorithm.epochs x algorithm.mini_batches optimizer steps     (trainer/rl_step.py)
        WeightSender.publish(model)              # every rank sends its own shards
        checkpoint every run.checkpoint_every steps                     (trainer/checkpoint.py)
        trainer 0: the step's metrics row                                (trainer/step_row.py)
    save the final policy as a Hugging Face directory
"""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from llamarl.parallel.weight_sender import WeightSender
from llamarl.parallel.weight_sync import open_sender
from llamarl.runtime.cores import threads_for
from llamarl.runtime.setup import Runtime, log
from llamarl.timeline import Timeline
from llamarl.trainer import checkpoint
from llamarl.trainer.lora import has_adapters, merged_state_dict
from llamarl.trainer.parts import TrainerParts, build_parts, write_run_files
from llamarl.trainer.policy import DTYPES
from llamarl.trainer.rl_step import policy_step
from llamarl.trainer.rollouts import RolloutReader
from llamarl.trainer.step_row import StepRecord, StepRows
from llamarl.trainer.step_timer import StepTimer
from llamarl.trainer.stop import StopRequest

TRAINER_BACKEND = {"cuda": "cpu:gloo,cuda:nccl", "cpu": "gloo"}


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


def run_trainer(rt: Runtime) -> None:
    """The loop of the module docstring on this trainer rank."""
    cfg, r, T = rt.cfg, rt.role.index, rt.layout.trainer_ranks
    mesh = init_trainer_group(rt)
    m = build_parts(rt, mesh)
    sender = open_sender(rt, m.policy)
    sender.guard(m.trainer.opt)  # large shards are sent straight from the parameters
    timeline = Timeline(rt.run_dir, rt.role.rank, rt.role.name)
    rollouts = RolloutReader(rt, timeline)
    rows = StepRows(rt, m, sender) if r == 0 else None
    log(rt, f"policy {m.model_path} sharded over {T} trainer rank(s); "
            f"sends {sender.bytes_per_sync / 2**20:.2f} MiB of shards per weight sync in "
            f"{len(sender.buckets)} bucket(s), {sum(sender.direct)} of them straight from the "
            "parameters")
    version, data_state = resume(rt, m)
    # The engines start with placeholder weights (vLLM's dummy load, generator/loop.py) and
    # take their first ones from here, new run or resumed: they sample from exactly the
    # trainer's policy whatever vLLM would have read from disk (a checkpoint with tied
    # embeddings stored as lm_head.weight alone loads in transformers, not in vLLM).
    sender.publish(m.policy, version)
    timer, stop, dropped_total = StepTimer(), StopRequest(rt.store, rt.run_dir, r), 0
    for step in range(version, cfg.run.steps):
        got = rollouts.next(step, version)
        timer.begin(got.wait_s, got.transfer_s)
        data_state.update(got.data_states())
        rm_row = {}
        if m.reward_model is not None:  # every rank, even with batch None: FSDP2 collectives
            with timeline.phase("reward_model", step):
                rm_row = m.reward_model.add_scores(got.batch, cfg.reward.model_weight,
                                                   cfg.trainer.micro_batch_size)
        with timer.measure("train_s"), timeline.phase("train", step):
            stats = policy_step(m.trainer, got.batch, cfg, m.tokenizer.pad_token_id, version,
                                got.dropped, m.reference, m.critic, m.teacher)
        dropped_total += int(stats["dropped"])
        with timer.measure("sync_s"):
            version += 1
            last = step + 1 == cfg.run.steps or stop.ends_at(version)  # (RUN_DIR/stop)
            publish_weights(rt, sender, m.policy, version, last, stop, timeline, step)
        every = cfg.run.checkpoint_every
        if every and (version % every == 0 or last):
            with timer.measure("checkpoint_s"), timeline.phase("checkpoint", step):
                save_checkpoint(rt, m, version, data_state)
        if rows is not None:
            rows.write(StepRecord(step + 1, version, got, stats, dropped_total, rm_row),
                       timer, last)
        if last:
            break
    sender.wait()
    final_dir = rt.run_dir / "policy"
    save_policy(m.policy, m.model_path, final_dir, r == 0, DTYPES[cfg.model.dtype])
    if r == 0:
        summarize(rt, final_dir, version)


def resume(rt: Runtime, m: TrainerParts) -> tuple[int, dict[str, dict]]:
    """The policy version the run starts from (0, or the resumed checkpoint's, its weights,
    optimizer and critic restored) and, per engine, the prompt loader's state after the last
    batch trained on (saved in every checkpoint, restored by the generators on resume)."""
    if not rt.resume:
        return 0, {}
    data_state = dict(rt.resume.get("data_state", {}))
    meta = checkpoint.load(Path(rt.resume["checkpoint"]), m.policy, m.trainer.opt,
                           m.trainer.sched, m.critic)
    log(rt, f"resumed from {rt.resume['checkpoint']} at step {meta['step']}")
    if rt.role.index == 0:  # only now: a resume that fails leaves the run's files as they were
        write_run_files(rt, m.model_path)
    return meta["policy_version"], data_state  # (below run.steps: runtime/setup.py checked)


def publish_weights(rt: Runtime, sender: WeightSender, model: torch.nn.Module, version: int,
                    last: bool, stop: StopRequest, timeline: Timeline, step: int) -> None:
    """Send policy `version` to the engines every sync.every versions and at the last step,
    which trainer 0 announces (the generators stop after it)."""
    cfg = rt.cfg
    if last and version < cfg.run.steps and rt.role.index == 0:
        log(rt, f"stopping at step {version} of {cfg.run.steps}: {stop.path} asked for it "
                "(run.resume=auto continues the run)")
    if last and rt.role.index == 0:
        rt.store.set("trainer/final_version", str(version))  # generators stop after it
    if last or version % cfg.sync.every == 0:
        with timeline.phase("sync", step):
            sender.publish(model, version)  # pack now, broadcast in the background


def save_checkpoint(rt: Runtime, m: TrainerParts, version: int,
                    data_state: dict[str, dict]) -> None:
    """Checkpoint policy `version` (collective): weights, optimizer, schedule, the critic's,
    and where each engine's prompts stand."""
    cfg = rt.cfg
    # a LoRA checkpoint holds the adapters only: export needs their config
    lora_meta = {"lora": dataclasses.asdict(cfg.model.lora)} if cfg.model.lora.rank else {}
    checkpoint.save(rt.run_dir, version, m.policy, m.trainer.opt, m.trainer.sched,
                    keep=cfg.run.keep_checkpoints, critic=m.critic, meta={
                        "policy_version": version, "model_path": m.model_path,
                        "dtype": cfg.model.dtype, "data_state": data_state, **lora_meta})


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
