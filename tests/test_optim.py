"""The optimizer's kernel: fused AdamW on a GPU, multi-tensor elsewhere, and a resume keeps the
resuming run's choice (an optimizer's state dict carries the saving run's flags)."""

from __future__ import annotations

import torch

from llamarl.config import load_config
from llamarl.trainer.checkpoint import _kernel_kept
from llamarl.trainer.optim import build_optimizer


def test_cpu_parameters_get_the_multi_tensor_adamw():
    model = torch.nn.Linear(4, 4)
    opt, _ = build_optimizer(model, load_config(None, []).trainer, 10)
    assert opt.param_groups[0]["foreach"] is True and not opt.param_groups[0]["fused"]


def test_loading_a_state_keeps_this_runs_kernel():
    saved = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))], foreach=True)
    saved.param_groups[0]["params"][0].grad = torch.ones(3)
    saved.step()
    fused = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))], fused=True)
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))], fused=True)
    plain.load_state_dict(saved.state_dict())
    assert plain.param_groups[0]["fused"] is None, "torch restores the saving run's flags"
    with _kernel_kept(fused):
        fused.load_state_dict(saved.state_dict())
    assert fused.param_groups[0]["fused"] is True and fused.param_groups[0]["foreach"] is None
    assert torch.equal(fused.state[fused.param_groups[0]["params"][0]]["exp_avg"],
                       saved.state[saved.param_groups[0]["params"][0]]["exp_avg"])
