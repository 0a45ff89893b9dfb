"""FSDP2 on 2 real gloo ranks takes the same GRPO step as one unsharded process."""

import torch
from conftest import DIST, torchrun
from test_buffer import make_batch

from llamarl.config import load_config
from llamarl.tiny.model import build_model
from llamarl.trainer.loop import policy_step
from llamarl.trainer.step import PolicyTrainer

CFG = ["trainer.micro_batch_size=3", "trainer.lr=1e-2", "trainer.ranks=2"]


def test_two_rank_fsdp2_step_matches_single_process(tmp_path):
    out = tmp_path / "fsdp.pt"
    proc = torchrun(2, [str(DIST / "fsdp_policy_step.py")], timeout=300, OUT=out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sharded = torch.load(out)

    cfg = load_config(None, CFG)
    model, tok = build_model(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = PolicyTrainer(model, cfg.trainer, 1, 1, torch.device("cpu"))
    stats = policy_step(trainer, make_batch(4, 4, seed=5), cfg, tok.pad_token_id)

    assert abs(stats["loss"] - sharded["stats"]["loss"]) < 1e-5
    assert abs(stats["grad_norm"] - sharded["stats"]["grad_norm"]) < 1e-4
    moved = 0.0
    for name, ref in model.state_dict().items():
        assert torch.allclose(sharded["state"][name], ref, atol=2e-5), name
        moved = max(moved, (ref - before[name]).abs().max().item())
    assert moved > 1e-3, "the step must actually change the weights"
