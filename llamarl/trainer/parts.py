"""The trainer's models, built once at start on every trainer rank (trainer/loop.py runs the
steps with them): the policy and its optimizer, the tokenizer, and whichever of the reference
policy, the teacher, the critic and the reward model the recipe uses, each FSDP2-sharded on
the trainer mesh."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from llamarl.models.resolve import resolve_model_path
from llamarl.registry.algorithms import algorithm
from llamarl.runtime.setup import Runtime, log
from llamarl.trainer.critic import build_critic, critic_metrics
from llamarl.trainer.lora import (
    AdaptersOff,
    add_adapters,
    has_adapters,
    store_frozen_in,
    trainable_count,
)
from llamarl.trainer.policy import DTYPES, load_frozen, load_policy, shard_for_training
from llamarl.trainer.reward_model import TrainerRewardModel, build_reward_model
from llamarl.trainer.step import PolicyTrainer
from llamarl.trainer.teacher import load_teacher, resolve_teacher_path, teacher_metrics


@dataclass
class TrainerParts:
    model_path: str  # the policy's Hugging Face directory (model.path resolved)
    policy: torch.nn.Module  # FSDP2-sharded, master weights in trainer.master_dtype
    trainer: PolicyTrainer  # the policy's optimizer and schedule
    tokenizer: object
    reference: torch.nn.Module | None = None  # algorithm.kl_coef > 0
    teacher: torch.nn.Module | None = None  # on_policy_distill
    critic: PolicyTrainer | None = None  # PPO
    reward_model: TrainerRewardModel | None = None  # reward.model_placement = trainer

    def model_metrics(self, stats: dict) -> dict:
        """The metrics row's entries of the models beside the policy, from the update's
        stats: the teacher's (trainer/teacher.py) and the critic's (trainer/critic.py)."""
        row = {}
        if self.teacher is not None:
            row.update(teacher_metrics(stats))
        if self.critic is not None:
            row.update(critic_metrics(stats))
        return row


def build_parts(rt: Runtime, mesh) -> TrainerParts:
    """Every model of the run on this trainer rank (collective: every trainer rank calls it)."""
    cfg, r, T = rt.cfg, rt.role.index, rt.layout.trainer_ranks
    model_path = resolve_model_path(cfg.model.path, leader=r == 0, barrier=dist.barrier,
                                    log=lambda m: log(rt, m),
                                    build_tiny=lambda task: tiny_warm_start(rt, mesh, task))
    teacher_path = resolve_teacher_path(cfg.algorithm.teacher_path, r,
                                        log=lambda m: log(rt, m) if r == 0 else None)
    if r == 0:
        rt.store.set("model/path", model_path)
    if r == 0 and not rt.resume:
        write_run_files(rt, model_path, recipe=False)  # setup wrote recipe.yaml
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    check_tokenizer(tokenizer, model_path)
    policy, trainer = build_policy(rt, model_path, mesh)
    m = TrainerParts(model_path, policy, trainer, tokenizer)
    m.reference = load_reference(cfg, model_path, mesh, rt.device, policy=policy)
    m.teacher = load_teacher(cfg, teacher_path, tokenizer, model_path, mesh, rt.device)
    if m.teacher is not None:
        log(rt, f"teacher {teacher_path} sharded over {T} trainer rank(s)")
    if algorithm(cfg.algorithm).critic:
        m.critic = build_critic(cfg, model_path, mesh, rt.device, optimizer_steps(cfg), T)
    m.reward_model = build_reward_model(cfg, tokenizer, mesh, rt.device)
    if m.reward_model is not None:
        log(rt, f"reward model {cfg.reward.model_path} sharded over {T} trainer rank(s)")
    return m


def build_policy(rt: Runtime, model_path: str, mesh) -> tuple[torch.nn.Module, PolicyTrainer]:
    """The policy (with model.lora's adapters), FSDP2-sharded, and its trainer."""
    cfg = rt.cfg
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
    shard_for_training(model, mesh, cfg.trainer, DTYPES[cfg.model.dtype])
    trainer = PolicyTrainer(model, cfg.trainer, optimizer_steps(cfg), rt.layout.trainer_ranks,
                            rt.device, cfg.generator.temperature, cfg.algorithm.entropy_coef > 0)
    return model, trainer


def optimizer_steps(cfg) -> int:
    """The run's optimizer steps (the learning-rate schedules' length)."""
    return cfg.run.steps * cfg.algorithm.epochs * cfg.algorithm.mini_batches


def tiny_warm_start(rt: Runtime, mesh, task: str) -> Path:
    """The embedded tiny model's warm start for `task`, trained by the trainer ranks together
    the first time and cached (model.path = tiny:<task>)."""
    from llamarl.models.tiny import warm_start_dir
    from llamarl.trainer.warmstart import run_warm_start

    path = warm_start_dir(task)
    if not (path / "config.json").is_file():
        log(rt, f"building the tiny model's warm start (cached at {path})")
        run_warm_start(task, path, mesh, rt.device,
                       log=lambda m: log(rt, m) if rt.role.index == 0 else None)
    return path


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
