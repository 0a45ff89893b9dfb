"""Warm start for the embedded tiny model: a short supervised phase, cached after the first run.

A randomly initialised policy never samples a correct reversal, so GRPO would see only zero
advantages. The warm start trains the same FSDP2 trainer (`PolicyTrainer`) with the supervised
loss below for a deliberately small number of steps: the policy learns the format and part of
the task, and RL has the rest to learn. The result is cached under
$LLAMARL_CACHE (default ~/.cache/llamarl) keyed by a hash of everything that shapes it
(llamarl/models/tiny.py: warm_start_dir, and the recipe's constants).

    L_sft = -(1 / N_tokens) * sum_{i,t} log pi_theta(y_it | x_i, y_i<t)    over answer + EOS tokens
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from llamarl.buffer.record import RolloutBatch, Sample
from llamarl.config import TrainerConfig
from llamarl.models.tiny import LOOKUP_TOOL_SHARE, SEED, SFT_BATCH, SFT_LR, SFT_STEPS
from llamarl.tiny import lookup
from llamarl.tiny import task as tasks
from llamarl.tiny.model import build_model, save_hf_dir
from llamarl.trainer.policy import TokenBatch, collate, pad_rollouts
from llamarl.trainer.step import PolicyTrainer


def sft_batches(tok, step: int, rank: int, dp: int, micro: int,
                task: str = "reverse") -> list[TokenBatch]:
    """This rank's share of SFT step `step`, as micro-batches."""
    if task == "lookup":
        return lookup_sft_batches(tok, step, rank, dp, micro)
    examples = tasks.sample_examples(SFT_BATCH, "train", seed=SEED * 100_000 + step)
    mine = examples[rank::dp]
    seqs = [(encode_prompt(tok, ex.prompt), tok.encode(ex.answer) + [tok.eos_token_id], [])
            for ex in mine]
    return [collate(seqs[i:i + micro], tok.pad_token_id) for i in range(0, len(seqs), micro)]


def lookup_sft_batches(tok, step: int, rank: int, dp: int, micro: int) -> list[TokenBatch]:
    """Lookup episodes as per-token records (loss on the turns, not on the prompt or the
    tool results), padded like rollouts."""
    import random

    rng = random.Random(SEED * 100_000 + step)
    samples = []
    for ex in lookup.sample_examples(SFT_BATCH, "train", seed=SEED * 100_000 + step)[rank::dp]:
        s = Sample()
        s.add_context([tok.bos_token_id])
        for kind, text in lookup.transcript(ex.row, rng.random() < LOOKUP_TOOL_SHARE, rng):
            if kind == "context":
                s.add_context(tok.encode(text))
            else:
                ids = tok.encode(text) + [tok.eos_token_id]
                s.add_sampled(ids, [0.0] * len(ids), 0)
        samples.append(s)
    full = pad_rollouts(RolloutBatch.from_samples(samples, [0.0] * len(samples),
                                                  list(range(len(samples))), 0),
                        tok.pad_token_id)
    return [full.take(list(range(i, min(i + micro, len(samples)))))
            for i in range(0, len(samples), micro)]


def encode_prompt(tok, prompt: str) -> list[int]:
    return [tok.bos_token_id] + tok.encode(prompt)


def run_warm_start(task: str, out_dir: Path, mesh, device: torch.device, log=print) -> None:
    """Train and save the warm start. A collective over the trainer ranks (`mesh`)."""
    from llamarl.parallel.fsdp import apply_fsdp

    if task not in SFT_STEPS:
        raise ValueError(f"model.path 'tiny:{task}': the embedded model knows the tasks "
                         f"{', '.join(SFT_STEPS)}; use model.path=tiny:reverse")
    steps = SFT_STEPS[task]
    dp = mesh.size() if mesh is not None else 1
    rank = mesh.get_local_rank() if mesh is not None else 0
    model, tok = build_model(SEED)
    model.to(device)
    if mesh is not None:
        apply_fsdp(model, mesh, torch.float32)
    trainer = PolicyTrainer(model, TrainerConfig(lr=SFT_LR, warmup_steps=5, grad_clip=1.0),
                            steps, dp, device)
    for step in range(steps):
        mbs = sft_batches(tok, step, rank, dp, micro=SFT_BATCH, task=task)
        n_tokens = torch.tensor(float(sum(mb.mask.sum() for mb in mbs)))
        if dist.is_initialized():
            dist.all_reduce(n_tokens)

        def loss_fn(logp, mb, _entropy, n=float(n_tokens)):
            return -(logp * mb.mask).sum() / n, {}

        stats = trainer.step(mbs, loss_fn)
        if step % 10 == 0 or step == steps - 1:
            log(f"warm start step {step + 1}/{steps}: sft loss {stats['loss']:.3f}")
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
             for k, v in model.state_dict().items()}
    if rank == 0:
        save_hf_dir(out_dir, state, model.config, tok)
    if dist.is_initialized():
        dist.barrier()
