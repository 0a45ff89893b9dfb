"""One optimizer step over micro-batches, shared by every loss (the policy's RL losses, the SFT
warm start, PPO's value loss through a `forward` that returns values instead of logprobs).

FSDP2 averages gradients over the D trainer ranks, so each rank back-propagates D x its share of
the global loss: the result is the gradient of the global loss, however the batch is cut.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from llamarl.config import TrainerConfig
from llamarl.parallel.fsdp import hold_gathered
from llamarl.trainer.optim import build_optimizer
from llamarl.trainer.policy import TokenBatch, token_logprobs

# loss_fn(out [B, T-1], micro-batch, entropy [B, T-1] or None) -> (loss share, stats of sums);
# `out` is what `forward` returns first (logprobs by default); what else the loss reads
# (advantages, returns, old values) is a field of the micro-batch
LossFn = Callable[[torch.Tensor, TokenBatch, torch.Tensor | None],
                  tuple[torch.Tensor, dict[str, torch.Tensor]]]
# forward(model, micro-batch) -> (out [B, T-1], entropy [B, T-1] or None)
Forward = Callable[[torch.nn.Module, TokenBatch], tuple[torch.Tensor, torch.Tensor | None]]


class PolicyTrainer:
    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig, total_steps: int,
                 dp_size: int, device: torch.device, temperature: float = 1.0,
                 entropy_grad: bool = False, forward: Forward | None = None,
                 name: str = "policy"):
        self.model = model
        self.name = name  # for error messages
        self.forward = forward or (lambda m, mb: token_logprobs(m, mb, self.temperature,
                                                                 self.entropy_grad))
        self.cfg = cfg
        self.dp_size = dp_size
        self.device = device
        self.temperature = temperature
        self.entropy_grad = entropy_grad  # an entropy bonus needs its gradient
        self.opt, self.sched = build_optimizer(model, cfg, total_steps)
        self.skipped_steps = 0  # total
        self.bad_streak = 0  # consecutive

    def step(self, micro_batches: list[TokenBatch], loss_fn: LossFn) -> dict[str, float]:
        """Forward/backward every micro-batch, clip, step. Returns scalars summed over ranks
        (`loss`, every stat) plus `grad_norm` and `lr`."""
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        sharded = hasattr(self.model, "set_requires_gradient_sync")  # FSDP2
        keep = sharded and self.cfg.keep_gathered_params
        if keep:
            hold_gathered(self.model, True)
        try:
            totals = self._forward_backward(micro_batches, loss_fn, sharded, keep)
        finally:
            # apply_fsdp's settings again for what runs between steps (the last backward has
            # freed the gathered parameters; a step that raised ends the run)
            if keep:
                hold_gathered(self.model, False)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        out = all_reduce_stats(totals)
        out["grad_norm"] = float(grad_norm)
        out["lr"] = self.sched.get_last_lr()[0]
        if math.isfinite(out["grad_norm"]) and math.isfinite(out["loss"]):
            self.opt.step()
            self.sched.step()  # the schedule counts real updates
            self.bad_streak = 0
        else:  # every rank sees the same reduced numbers, so all skip together
            self.skipped_steps += 1
            self.bad_streak += 1
            out["skipped"] = 1.0
            if self.bad_streak >= self.cfg.max_bad_steps:
                raise RuntimeError(
                    f"{self.name} loss or gradient norm was NaN/inf for {self.bad_streak} steps "
                    f"in a row (last loss {out['loss']}, grad norm {out['grad_norm']}): lower "
                    f"{'critic' if self.name == 'critic' else 'trainer'}.lr, check the rewards, "
                    "or raise trainer.max_bad_steps")
        out["skipped_total"] = float(self.skipped_steps)
        return out

    def _forward_backward(self, micro_batches: list[TokenBatch], loss_fn: LossFn, sharded: bool,
                          keep: bool) -> dict[str, torch.Tensor]:
        """Accumulate every micro-batch's gradient; returns the local sums of the stats."""
        totals: dict[str, torch.Tensor] = {"loss": torch.zeros((), device=self.device)}
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            if sharded:
                self.model.set_requires_gradient_sync(i == last)  # reduce-scatter once
                if keep:  # gathered once per step: free them after the last backward only
                    self.model.set_reshard_after_backward(i == last)
            mb = mb.to(self.device)
            out, entropy = self.forward(self.model, mb)
            loss, stats = loss_fn(out, mb, entropy)
            (loss * self.dp_size).backward()
            totals["loss"] += loss.detach()
            if entropy is not None:
                stats = dict(stats, entropy_sum=(entropy.detach() * mb.mask).sum())
            for k, v in stats.items():
                if k.endswith("_max"):
                    totals[k] = torch.maximum(totals.get(k, v.detach()), v.detach())
                elif k.endswith("_min"):
                    totals[k] = torch.minimum(totals.get(k, v.detach()), v.detach())
                else:
                    totals[k] = totals.get(k, torch.zeros((), device=self.device)) + v.detach()
        return totals


def all_reduce_stats(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """Reduce scalars over the default (trainer) group: keys ending in _max by max, in _min by
    min, all others by sum."""
    keys = sorted(stats)
    if not dist.is_initialized():
        return {k: float(stats[k]) for k in keys}
    ops = {"_max": dist.ReduceOp.MAX, "_min": dist.ReduceOp.MIN}
    groups: dict = {}
    for k in keys:
        groups.setdefault(ops.get(k[-4:], dist.ReduceOp.SUM), []).append(k)
    out = {}
    for op, names in groups.items():
        t = torch.stack([stats[k].float().reshape(()) for k in names])
        dist.all_reduce(t, op=op)
        out.update(zip(names, t.tolist()))
    return out
