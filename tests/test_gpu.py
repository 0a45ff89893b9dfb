"""GPU paths (marked `gpu`: skipped without CUDA, never faked): the FSDP2 RL update on NCCL with
one GPU per rank, against the same update on CPU; vLLM's CUDA engine. Tests that need two GPUs
(NCCL between two ranks: NCCL refuses two ranks on one device) skip on a one-GPU machine."""

from __future__ import annotations

import pytest
import torch
from conftest import DIST, torchrun

pytestmark = pytest.mark.gpu
PPO = ("algorithm.name=ppo algorithm.epochs=2 algorithm.kl_coef=0.1 algorithm.kl_mode=reward "
       "algorithm.kl_estimator=k1 critic.lr=1e-3")


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def launch(nproc: int, out, **env) -> dict:
    proc = torchrun(nproc, [str(DIST / "fsdp_policy_step.py")], timeout=600, OUT=out, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def compare(cpu: dict, gpu: dict, atol: float) -> None:
    for key in ("loss", "grad_norm", "value_loss", "kl_ref"):
        if key in cpu["stats"]:
            assert gpu["stats"][key] == pytest.approx(cpu["stats"][key], rel=1e-3, abs=1e-5), key
    for part in ("state", "critic"):
        for name, ref in cpu.get(part, {}).items():
            assert torch.allclose(gpu[part][name], ref, atol=atol), (part, name)


@pytest.mark.parametrize("extra", ["", PPO], ids=["grpo", "ppo"])
def test_cuda_fsdp2_update_matches_cpu(tmp_path, tiny_model_dir, extra):
    env = {"MODEL_DIR": tiny_model_dir, "EXTRA": extra}
    cpu = launch(1, tmp_path / "cpu.pt", DEVICE="cpu", **env)
    gpu = launch(1, tmp_path / "gpu.pt", DEVICE="cuda", **env)
    compare(cpu, gpu, atol=5e-4)  # fp32 on both; kernels differ in summation order


@pytest.mark.skipif(gpus() < 2, reason="needs 2 GPUs (NCCL between two ranks)")
def test_two_gpu_nccl_update_matches_one_gpu(tmp_path, tiny_model_dir):
    env = {"MODEL_DIR": tiny_model_dir, "EXTRA": PPO, "DEVICE": "cuda"}
    compare(launch(1, tmp_path / "one.pt", **env), launch(2, tmp_path / "two.pt", **env),
            atol=5e-4)


@pytest.mark.skipif(gpus() < 1, reason="needs a CUDA GPU")
def test_gpu_visibility_set_after_counting_the_gpus_takes_effect():
    """runtime/gpus.py counts the node's GPUs (torch.cuda.device_count, through NVML) and then
    sets CUDA_VISIBLE_DEVICES: counting must not have started CUDA, or the setting would be
    ignored. Hiding every GPU after counting must leave the process none."""
    import subprocess
    import sys

    from conftest import ROOT, child_env

    code = ("import os, torch\n"
            "from llamarl.runtime.gpus import node_gpus\n"
            "n = len(node_gpus(os.environ))\n"
            "os.environ['CUDA_VISIBLE_DEVICES'] = ''\n"
            "print(n, torch.cuda.is_available())\n")
    env = child_env()
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(gpus()), "False"], proc.stdout


@pytest.mark.skipif(gpus() < 1, reason="needs a CUDA GPU")
def test_launch_places_the_engine_on_its_ranks_gpu(tmp_path):
    """A trainer rank and an engine rank under torchrun, placed and set up as llamarl.launch
    does: the trainer on GPU 0; the engine's process sees its own GPU (local rank 1 of the
    node's GPUs; GPU 0 again on a one-GPU machine) as the cuda:0 that vLLM's worker takes."""
    import json

    proc = torchrun(2, [str(DIST / "gpu_placement.py")], timeout=300, OUT=tmp_path / "p",
                    RUNS=tmp_path / "runs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(gpus())]
    trainer, engine = (json.loads((tmp_path / f"p.{r}").read_text()) for r in (0, 1))
    print(trainer, engine)
    assert trainer["uuid"] == uuids[0]
    assert engine["uuid"] == engine["vllm_uuid"] == uuids[1 % gpus()], (engine, uuids)
    if gpus() > 1:
        assert engine["device_count"] == 1 and engine["visible"] == "1"


@pytest.mark.skipif(gpus() < 3, reason="needs 3 GPUs: a sender and two engines over NCCL")
def test_aborting_a_lost_engines_pair_group_releases_the_send(tmp_path):
    """sync.weight_groups pairs on NCCL (what lets a GPU job go on after an engine loss): a
    send to a dead engine holds until its pair group is aborted, then ends, and the pair with
    the live engine goes on."""
    import json

    proc = torchrun(3, [str(DIST / "nccl_pair_abort.py")], timeout=300, OUT=tmp_path / "r")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "r.0").read_text())
    assert r["aborted"] and r["released_s"] < 60, r


def test_vllm_cuda_engine_generates_with_logprobs(tiny_model_dir):
    pytest.importorskip("vllm", reason="vLLM (CUDA build) is not installed")
    import subprocess
    import sys

    from conftest import ROOT, child_env

    code = ("from llamarl.config import GeneratorConfig\n"
            "from llamarl.generator.engine import Engine\n"
            "if __name__ == '__main__':\n"
            f"    e = Engine({str(tiny_model_dir)!r}, GeneratorConfig(max_model_len=64), "
            "'float32', 0, False)\n"
            "    (g,) = e.generate([[1, 4, 5, 16]], 4, 1.0, 8, seed=0)\n"
            "    assert len(g) == 4 and all(len(c.logprobs) == len(c.token_ids) for c in g)\n"
            "    print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_cuda_trainer_reward_model_matches_cpu(tmp_path, tiny_reward_model_dir, dtype, tol):
    from llamarl.buffer.record import RolloutBatch
    from llamarl.tiny.model import build_tokenizer
    from llamarl.trainer.reward_model import TrainerRewardModel

    proc = torchrun(1, [str(DIST / "trainer_reward_model.py")], timeout=600, DEVICE="cuda",
                    DTYPE=dtype, RM_DIR=tiny_reward_model_dir, OUT=tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = torch.load(tmp_path / "out.0")
    batch = RolloutBatch(**out["all"]["batch"])
    cpu = TrainerRewardModel(str(tiny_reward_model_dir), build_tokenizer(), "float32",
                             torch.device("cpu")).score(batch, 2)
    assert out["sharded"]
    assert out["all"]["scores"].tolist() == pytest.approx(cpu.tolist(), abs=tol)
    assert out["all"]["mean"] == pytest.approx(float(cpu.mean()), abs=tol)


@pytest.mark.skipif(gpus() < 4, reason="needs 4 GPUs: 2 trainer ranks + one engine of tp 2")
def test_tp2_engine_weight_parity_over_nccl(tmp_path, tiny_model_dir):
    """tests/test_weight_sync.py's tp 2 parity on GPUs: NCCL weight groups, the per-tp-rank
    broadcast groups of the resharded second sync, vLLM's CUDA engine under the external
    launcher."""
    pytest.importorskip("vllm", reason="vLLM (CUDA build) is not installed")
    import json

    out = tmp_path / "parity.json"
    proc = torchrun(4, [str(DIST / "weight_sync_parity.py")], timeout=900, OUT=out,
                    MODEL_DIR=tiny_model_dir, RUNS=tmp_path / "runs", TP=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["greedy_match"] and r["max_abs_dlogprob"] <= 1e-3, r
    assert r["qkv_rows"] == 128 and r["bytes_resharded"] < 0.6 * r["bytes_full"], r


@pytest.mark.skipif(gpus() < 1, reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile", ["", "head", "blocks", "blocks_budget"],
                         ids=["eager", "compiled_head", "compiled_blocks",
                              "compiled_blocks_memory_budget"])
def test_packed_logprobs_on_cuda_match_padded(compile):
    """A packed micro-batch on CUDA (torch's varlen flash attention with grouped KV heads, the
    chunked head, and as trainer.compile does it the head's compiled softmax passes, then
    also the decoder blocks compiled with the varlen attention traced into them) gives the
    padded batch's logprobs and gradients (bfloat16 compute: loose tolerances), also for a
    second packing of other lengths (the compiled blocks must not be specialised to the
    first). compiled_blocks_memory_budget: the same, with trainer.activation_memory_budget
    0.5 (backward recomputes part of each block's forward)."""
    import torch._functorch.config as functorch_config
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from llamarl.trainer import linear_logprobs
    from llamarl.trainer.policy import TokenBatch, token_logprobs
    from llamarl.trainer.varlen_attention import implementation

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=5000, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512)
    model = Qwen2ForCausalLM._from_config(cfg, attn_implementation=implementation("sdpa"),
                                          dtype=torch.bfloat16).cuda()
    model.config.use_cache = False
    B, T = 4, 300
    ids = torch.randint(0, 5000, (B, T))
    budget = functorch_config.activation_memory_budget
    if compile == "blocks_budget":
        functorch_config.activation_memory_budget = 0.5
    if compile.startswith("blocks"):
        for layer in model.model.layers:
            layer.compile(dynamic=True)
    linear_logprobs.use_compiled(bool(compile))
    try:
        for lens in ((300, 120, 37, 211), (64, 250, 9, 180)):
            attn = torch.zeros(B, T, dtype=torch.long)
            for i, n in enumerate(lens):
                attn[i, :n] = 1
            batch = TokenBatch(ids, attn, ids[:, 1:].clone(), attn[:, 1:].float(),
                               torch.zeros(B, T - 1))
            outs = []
            for mb in (batch, batch.pack()):
                model.zero_grad()
                lp, _ = token_logprobs(model, mb.to(torch.device("cuda")), 1.0, chunk_mib=0.5)
                (lp * mb.mask.cuda()).sum().backward()
                outs.append((lp.detach() * mb.mask.cuda(),
                             [p.grad.float().clone() for p in model.parameters()]))
            (a, ga), (b, gb) = outs
            assert (a - b).abs().max() < 0.1, (lens, (a - b).abs().max())
            for x, y in zip(ga, gb):
                assert torch.allclose(x, y, rtol=0.1, atol=0.05 * float(x.abs().max()) + 1e-3)
    finally:
        linear_logprobs.use_compiled(False)
        functorch_config.activation_memory_budget = budget
