"""The teacher of on-policy distillation (algorithm.name = on_policy_distill) on the trainer ranks.

At start, each trainer rank:
  1. resolves algorithm.teacher_path: a local Hugging Face directory, or a teacher that one of
     llamarl's recipes trains (tiny-grpo:reverse, smollm2-grpo:add), which trainer 0 builds and
     caches the first time (llamarl/models/recipe_teacher.py) while the other ranks wait;
  2. refuses, in one line, a teacher whose tokenizer is not the policy's: distillation compares
     the two models' logprobs of the same token ids, so both must read them as the same tokens;
  3. loads it frozen (no gradients, eval mode) in model.dtype and FSDP2-shards it over the
     trainer mesh like the reference policy (its forwards are collectives, run in the update's
     micro-batches: trainer/rl_step.py, no_grad_passes).

After a batch arrives, the update scores every sampled token with it (algorithms/distill.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from llamarl.config import RECIPE_TEACHERS
from llamarl.trainer.policy import load_frozen


def resolve_teacher_path(spec: str, rank: int, log=print) -> str:
    """The teacher's Hugging Face directory for algorithm.teacher_path `spec` ("" = none).
    A name in RECIPE_TEACHERS: trainer `rank` 0 builds it when it is not cached yet (a
    collective: every trainer rank calls this)."""
    if not spec:
        return ""
    if spec in RECIPE_TEACHERS:
        from llamarl.models.recipe_teacher import build_teacher, teacher_dir

        path = teacher_dir(spec)
        if rank == 0 and not (path / "config.json").is_file():
            build_teacher(spec, path, log)
        if dist.is_initialized():
            dist.barrier()
        return str(path)
    if not (Path(spec) / "config.json").is_file():
        raise ValueError(f"algorithm.teacher_path {spec!r} is not a Hugging Face model "
                         "directory (no config.json): point it at a local checkpoint with the "
                         f"policy's tokenizer, or one of {', '.join(RECIPE_TEACHERS)}")
    return spec


def check_teacher_tokenizer(teacher_tokenizer, policy_tokenizer, teacher_path: str,
                            policy_path: str) -> None:
    """Raise a one-line ValueError unless both tokenizers map the same tokens to the same ids."""
    ours, theirs = policy_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if ours == theirs:
        return
    differ = sum(theirs.get(tok) != i for tok, i in ours.items())
    raise ValueError(
        f"algorithm.teacher_path {teacher_path!r} has another tokenizer than the policy "
        f"{policy_path!r} ({differ} of the policy's {len(ours)} tokens have another id or none, "
        f"the teacher has {len(theirs)}): distillation scores the student's token ids with the "
        "teacher, so use a teacher that shares the student's tokenizer")


def load_teacher(cfg, teacher_path: str, policy_tokenizer, policy_path: str, mesh,
                 device: torch.device) -> torch.nn.Module | None:
    """The frozen teacher, FSDP2-sharded on `mesh` (None: unsharded); None without one."""
    if not teacher_path:
        return None
    from transformers import AutoTokenizer

    check_teacher_tokenizer(AutoTokenizer.from_pretrained(teacher_path), policy_tokenizer,
                            teacher_path, policy_path)
    return load_frozen(teacher_path, cfg, mesh, device)


def teacher_metrics(stats: dict) -> dict:
    """The teacher's entry of the metrics row: the per-token reverse KL from the policy to the
    teacher over the step's sampled tokens (algorithms/distill.py; summed by rl_step)."""
    return {"kl_teacher": stats["kl_teacher"] / max(stats["n_tokens"], 1.0)}
