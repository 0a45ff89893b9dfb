"""The optimizer's kernel: fused AdamW on a GPU and a CPU (the same update as the multi-tensor
one to float rounding), and a resume keeps the resuming run's choice (an optimizer's state dict
carries the saving run's flags)."""

from __future__ import annotations

import torch

from llamarl.config import load_config
from llamarl.trainer.checkpoint import _kernel_kept
from llamarl.trainer.optim import build_optimizer


def test_cpu_parameters_get_the_fused_adamw_with_the_multi_tensor_update():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    reference = torch.nn.Linear(64, 32)
    reference.load_state_dict(model.state_dict())
    initial = model.weight.detach().clone()
    cfg = load_config(None, []).trainer
    opt, _ = build_optimizer(model, cfg, 10)
    assert opt.param_groups[0]["fused"] is True and not opt.param_groups[0]["foreach"]
    multi = torch.optim.AdamW(reference.parameters(), lr=cfg.lr, betas=tuple(cfg.betas),
                              weight_decay=cfg.weight_decay, foreach=True)
    for _ in range(5):
        x = torch.randn(8, 64)
        for m, o in ((model, opt), (reference, multi)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert (model.weight - initial).abs().max() > 2 * cfg.lr  # five steps of up to about lr


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
