"""LoRA (model.lora, llamarl/trainer/lora.py): the recipe keys, and two FSDP2 gloo ranks
taking GRPO updates with a KL term to the reference (tests/dist/lora_policy_step.py): only
the adapters learn, the reference is the base model exactly, the weight sync sends the merged
weights, and a checkpoint resumes the update bit for bit."""

import json
from pathlib import Path

import pytest
import torch
from conftest import DIST, torchrun

from llamarl.config import LORA_TARGETS, load_config
from llamarl.parallel.adapters import is_trainable, is_trained_copy
from llamarl.tiny.model import build_model
from llamarl.trainer.lora import add_adapters, merged_state_dict
from llamarl.trainer.policy import pad_rollouts, token_logprobs

# as tests/dist/lora_policy_step.py
STEP_CFG = ["trainer.micro_batch_size=3", "trainer.lr=1e-2", "trainer.ranks=2",
            "trainer.share_prompts=false", "model.lora.rank=4", "model.lora.alpha=8",
            "algorithm.kl_coef=0.1"]
NORM = "model.lora.modules_to_save=[norm]"
NORM_COPY = "model.norm.modules_to_save.default.weight"  # the final norm's trained copy


@pytest.mark.parametrize("override, key", [
    ("model.lora.rank=-1", "model.lora.rank"),
    ("model.lora.alpha=0", "model.lora.alpha"),
    ("model.lora.dropout=1.0", "model.lora.dropout"),
    ("model.lora.target_modules=[lm_head]", "model.lora.target_modules"),
    ("model.lora.target_modules=[]", "model.lora.target_modules"),
    ("model.lora.sync=deltas", "model.lora.sync"),
    ("model.lora.sync=adapters model.lora.rank=1024", "model.lora.rank"),
    ("model.lora.modules_to_save=[lm_head]", "model.lora.modules_to_save"),
    ("model.lora.sync=adapters model.lora.modules_to_save=[norm]",
     "model.lora.modules_to_save"),
    ("algorithm.name=ppo", "model.lora.rank"),
])
def test_bad_lora_keys_are_one_line_errors(override, key):
    with pytest.raises(ValueError, match=f"recipe key '{key}'") as e:
        load_config(None, ["model.lora.rank=8", *override.split()])
    assert "\n" not in str(e.value)


def test_adapter_syncs_are_a_recipe_choice():
    from llamarl.config import adapter_sync, reshards
    from llamarl.generator.lora_adapter import adapter_config, engine_lora_rank

    cfg = load_config(None, ["model.lora.rank=4", "model.lora.alpha=8",
                             "model.lora.sync=adapters"])
    assert adapter_sync(cfg) and not reshards(cfg), "tp ranks get the adapters whole"
    merged = load_config(None, ["model.lora.rank=4"])
    assert not adapter_sync(merged) and reshards(merged)
    assert adapter_config(cfg.model.lora) == {"r": 4, "lora_alpha": 8.0, "bias": "none",
                                              "target_modules": list(LORA_TARGETS)}
    # vLLM builds engines for ranks 1, 8, 16, ...: the smallest that holds the adapter
    assert [engine_lora_rank(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]


def test_adapter_syncs_send_a_and_b_alone_in_peft_names(tmp_path):
    """model.lora.sync adapters, one process (no FSDP2), through the filesystem transport:
    the sender's pieces are the adapters (weight_plan.model_tensors), r (in + out) values per
    adapted linear; a receiver that does not replay (WeightReceiver(replay=False)) hands
    every sync whole to its target's load_weights, in PEFT's saved names
    (lora.adapter_state_dict), which vLLM's LoRA loader reads."""
    from llamarl.parallel.transports.base import TransportSpec
    from llamarl.parallel.weight_sync import open_weight_sync
    from llamarl.trainer.lora import adapter_state_dict

    cfg = load_config(None, ["model.lora.rank=4", "model.lora.sync=adapters"])
    model, _ = build_model(seed=0)
    add_adapters(model, cfg.model.lora, seed=0)
    spec = [TransportSpec("filesystem", me, senders=1, receivers=1, directory=str(tmp_path),
                          timeout_s=30.0) for me in (0, 1)]
    cpu = torch.device("cpu")
    published = []
    sender = open_weight_sync("send", spec[0], 1, cpu, model=model, adapters=True,
                              publish_metas=published.append)
    receiver = open_weight_sync("receive", spec[1], 1, cpu, metas=published, adapters=True)
    per_linear = {"q_proj": 128 + 128, "k_proj": 128 + 64, "v_proj": 128 + 64,
                  "o_proj": 128 + 128, "gate_proj": 128 + 256, "up_proj": 128 + 256,
                  "down_proj": 256 + 128}
    assert sender.bytes_per_sync == 2 * 4 * 4 * sum(per_linear.values())  # 2 blocks, fp32

    class Adapter:  # stands in for generator/lora_adapter.EngineAdapter
        def load_weights(self, weights):
            self.got = {name: t.clone() for name, t in weights}

    target = Adapter()
    for sync in range(2):
        with torch.no_grad():  # the adapters move; nothing else is sent
            for name, p in model.named_parameters():
                if ".lora_" in name:
                    p.normal_(0, 0.1)
        sender.publish(model, version=None)
        sender.wait()
        receiver.post()
        receiver.load(target)
        expected = adapter_state_dict(model)
        assert set(target.got) == set(expected)
        assert all(torch.equal(target.got[k], t) for k, t in expected.items()), sync
    assert receiver.replay is None, "nothing recorded: the adapter takes every sync"


def test_lora_is_off_by_default_and_ignored_when_off():
    cfg = load_config(None, ["model.lora.sync=adapters"])  # rank 0: nothing is checked
    assert cfg.model.lora.rank == 0


@pytest.mark.parametrize("extra", ["", NORM], ids=["adapters", "adapters+norm"])
def test_merged_weights_compute_what_the_adapted_model_computes(extra):
    """The base model loaded with lora.merged_state_dict gives the adapted model's logprobs
    (W x + s B A x against (W + s B A) x: float rounding), in one process without FSDP2;
    with the final norm trained beside the adapters, under the base name."""
    from test_buffer import make_batch

    cfg = load_config(None, ["model.lora.rank=4", *extra.split()])
    model, tok = build_model(seed=0)
    add_adapters(model, cfg.model.lora, seed=0)
    with torch.no_grad():  # B = 0 at the start: make the adapters do something
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
            if is_trained_copy(name):  # (and the norm's copy, when trained)
                p.mul_(1.5)
    merged = merged_state_dict(model)
    base, _ = build_model(seed=1)
    assert base.load_state_dict(merged, strict=True)
    batch = pad_rollouts(make_batch(3, 2, seed=9), tok.pad_token_id)
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch, 1.0)
        lp_merged, _ = token_logprobs(base, batch, 1.0)
        lp_plain, _ = token_logprobs(build_model(seed=0)[0], batch, 1.0)
    assert (lp - lp_merged).abs().max() < 1e-5
    assert (lp - lp_plain).abs().max() > 1e-3, "the adapters must change the model"


@pytest.fixture(scope="module", params=["", NORM], ids=["adapters", "adapters+norm"])
def two_ranks(request, tmp_path_factory, tiny_model_dir):
    """tests/dist/lora_policy_step.py's results, with the adapters alone and with the final
    norm trained beside them (model.lora.modules_to_save)."""
    out = tmp_path_factory.mktemp("lora") / "out.pt"
    proc = torchrun(2, [str(DIST / "lora_policy_step.py")], timeout=300, OUT=out,
                    MODEL_DIR=tiny_model_dir, EXTRA=request.param)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {**torch.load(out, weights_only=False), "extra": request.param}


def test_only_the_adapters_learn(two_ranks):
    r = two_ranks
    assert r["grads"] == r["adapters"] and r["adapters"], "gradients: adapters only"
    assert r["opt_params"] == len(r["adapters"]) == r["opt_state"], "optimizer: adapters only"
    for name, before in r["base_before"].items():
        assert torch.equal(r["base_after"][name], before), name  # the base, bit for bit
    b = [v for k, v in r["adapters_after"].items() if ".lora_B." in k]
    assert max(t.abs().max().item() for t in b) > 1e-3, "B starts at 0 and must move"
    if r["extra"]:  # the final norm: its copy trained, the original (the reference's) kept
        assert NORM_COPY in r["grads"]
        original = r["base_after"]["model.norm.original_module.weight"]
        assert torch.equal(r["base_before"]["model.norm.original_module.weight"], original)
        assert (r["adapters_after"][NORM_COPY] - original).abs().max() > 1e-4


def test_reference_is_the_base_model_exactly(two_ranks):
    r = two_ranks
    assert torch.equal(r["ref_logp"], r["base_logp"])
    assert (r["policy_logp"] - r["base_logp"]).abs().max() > 1e-3, "the policy has moved"
    assert r["stats"]["kl_ref"] >= 0


def test_weight_sync_sends_merged_weights_under_the_base_names(two_ranks):
    r = two_ranks
    sent, merged, base = r["merged_local"], r["merged_full"], r["base_after"]
    tied = {"lm_head.weight"}  # the tiny model ties it to the embeddings: sent once
    assert set(sent) == set(build_model(seed=0)[0].state_dict()) - tied  # the base's names
    assert set(merged) == set(sent) | tied
    for name, t in sent.items():
        assert torch.allclose(t, merged[name], atol=1e-6), name
    if r["extra"]:  # the trained norm under the base name, not the reference's original
        assert torch.equal(sent["model.norm.weight"], r["adapters_after"][NORM_COPY])
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(sent[q], base["model.layers.0.self_attn.q_proj.base_layer.weight"])
    assert r["bytes_per_sync"] == r["bytes_per_sync_base"], "the base model's layout"


def test_checkpoint_holds_adapters_and_resumes_bitwise(two_ranks):
    from torch.distributed.checkpoint import FileSystemReader

    r = two_ranks
    saved = FileSystemReader(r["checkpoint"]).read_metadata().state_dict_metadata
    model_keys = {k.split(".", 1)[1] for k in saved if k.startswith("model.")}
    assert model_keys == set(r["adapters"]), "the checkpoint's model: the adapters only"
    for name, t in r["adapters_after"].items():
        assert torch.equal(r["resumed"][name], t), name


def test_export_writes_a_peft_adapter_and_the_merged_model(two_ranks, tmp_path):
    """llamarl.export of the LoRA checkpoint: the merged HF directory and the PEFT adapter
    directory on the base load in transformers and agree (logprobs to float rounding, greedy
    tokens exactly), and they hold the checkpoint's adapters (not the base model)."""
    from peft import PeftModel
    from test_buffer import make_batch
    from transformers import AutoModelForCausalLM

    from llamarl.export import export

    out = export(two_ranks["checkpoint"], tmp_path / "export")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base_path = json.loads((Path(two_ranks["checkpoint"]) / "meta.json").read_text())[
        "model_path"]
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32), str(out / "adapter"))
    _, tok = build_model(seed=0)
    batch = pad_rollouts(make_batch(3, 2, seed=9), tok.pad_token_id)
    with torch.no_grad():
        lp_merged = token_logprobs(merged, batch, 1.0)[0]
        lp_adapted = token_logprobs(adapted, batch, 1.0)[0]
        lp_base = token_logprobs(base, batch, 1.0)[0]
        ids = torch.tensor([[tok.bos_token_id] + tok.encode("abcd=", add_special_tokens=False)])
        greedy = [m.generate(ids, max_new_tokens=8, do_sample=False)[0].tolist()
                  for m in (merged, adapted)]
    assert (lp_merged - lp_adapted).abs().max() < 1e-5
    assert (lp_merged - lp_base).abs().max() > 1e-3, "the adapters are in the export"
    assert greedy[0] == greedy[1]
    saved = {k.replace(".lora_A.weight", ".lora_A.default.weight")
             .replace(".lora_B.weight", ".lora_B.default.weight"): v
             for k, v in adapted.state_dict().items() if ".lora_" in k or is_trained_copy(k)}
    assert len(saved) == len(two_ranks["adapters_1"])
    if two_ranks["extra"]:  # PEFT's directory names the norm as one of its modules_to_save
        config = json.loads((out / "adapter" / "adapter_config.json").read_text())
        assert config["modules_to_save"] == ["model.norm"]  # (PEFT matches by suffix)
        assert torch.equal(merged.model.norm.weight, two_ranks["adapters_1"][NORM_COPY])
    for name, t in two_ranks["adapters_1"].items():
        assert torch.equal(saved["base_model.model." + name], t), name


def test_export_greedy_agrees_in_transformers_and_vllm(two_ranks, tmp_path):
    """The exported LoRA policy in vLLM generates what it generates in transformers (greedy,
    llamarl.model_check): with the adapters alone, the PEFT adapter directory on the base
    (PeftModel against vLLM's LoRA layers with a LoRARequest naming it); with the final norm
    trained too, which vLLM's LoRA loader does not take, the merged directory."""
    import subprocess
    import sys

    from conftest import ROOT, child_env
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llamarl.export import export
    from llamarl.model_check import LOGPROB_TOL, PLAIN_PROMPTS, greedy_hf

    out = export(two_ranks["checkpoint"], tmp_path / "export")
    base = json.loads((Path(two_ranks["checkpoint"]) / "meta.json").read_text())["model_path"]
    # the check can fail: the exported policy's greedy logprobs are not the base model's
    tok = AutoTokenizer.from_pretrained(base)
    ids = [tok.bos_token_id] + tok.encode(PLAIN_PROMPTS[0], add_special_tokens=False)
    lps = [greedy_hf(AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32), ids, 8)[2]
           for m in (base, out)]
    assert max(abs(a - b) for a, b in zip(*lps)) > 10 * LOGPROB_TOL, lps
    args = [str(out)] if two_ranks["extra"] else [base, "--adapter", str(out / "adapter")]
    tmp = tmp_path / "tmp"  # (the check leaves nothing there: vLLM's FileStore is removed)
    tmp.mkdir()
    check = subprocess.run([sys.executable, "-m", "llamarl.model_check", *args], cwd=ROOT,
                           env=child_env(TMPDIR=tmp), capture_output=True, text=True,
                           timeout=600)
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-3000:]
    assert "greedy generation agrees" in check.stdout
    assert not list(tmp.glob("vllm_dist_*")), list(tmp.iterdir())


def test_a_frozen_base_kept_in_the_compute_dtype_takes_the_same_update(two_ranks):
    """With bfloat16 compute, a base stored in bfloat16 (lora.store_frozen_in, what the
    trainer does) gives the update a float32 base gives bit for bit: FSDP2 casts every
    parameter to bfloat16 for the forward either way. Only the merged weights differ, by the
    base's bfloat16 rounding, and the base takes half the memory."""
    f32, b16 = two_ranks["bf16_twins"]
    assert f32["dtypes"] == ["torch.float32"]
    assert b16["dtypes"] == ["torch.bfloat16", "torch.float32"]
    assert b16["saved"] == 2 * b16["frozen"] > 0 and f32["saved"] == 0
    for key in ("loss", "grad_norm", "kl_ref"):
        assert f32["stats"][key] == b16["stats"][key], key
    for name, t in f32["adapters"].items():
        assert torch.equal(b16["adapters"][name], t), name
    adapted = {k.replace(".lora_A.default.weight", ".weight") for k in f32["adapters"]
               if ".lora_A." in k}
    assert adapted
    for name, t in f32["merged"].items():
        got = b16["merged"][name]
        if name in adapted:  # W + s B A, computed in float32 from W as stored: W's rounding
            w = two_ranks["base_before"][name.replace(".weight", ".base_layer.weight")]
            assert got.dtype == torch.float32, name
            assert torch.allclose(got - t, w.to(torch.bfloat16).float() - w, atol=1e-6), name
        elif name == "model.norm.weight" and two_ranks["extra"]:  # trained: kept in float32
            assert torch.equal(got, t), name
        else:  # a frozen tensor as stored
            assert torch.equal(got, t.to(torch.bfloat16)), name


def test_two_ranks_take_the_update_of_one_process(two_ranks):
    """The first update of tests/dist/lora_policy_step.py (two FSDP2 ranks, half the batch
    each) is the update one unsharded process takes on the whole batch: FSDP2 reduces the
    adapters' gradients beside the frozen weights as it does for a fully trained model."""
    from test_buffer import make_batch

    from llamarl.trainer.parts import load_reference
    from llamarl.trainer.rl_step import policy_step
    from llamarl.trainer.step import PolicyTrainer

    cfg = load_config(None, STEP_CFG + two_ranks["extra"].split())
    model, tok = build_model(seed=0)
    add_adapters(model, cfg.model.lora, seed=cfg.run.seed)
    trainer = PolicyTrainer(model, cfg.trainer, 2, 1, torch.device("cpu"))
    reference = load_reference(cfg, "", None, torch.device("cpu"), policy=model)
    stats = policy_step(trainer, make_batch(4, 4, seed=5), cfg, tok.pad_token_id,
                        reference=reference)
    assert stats["loss"] == pytest.approx(two_ranks["stats"]["loss"], abs=1e-5)
    assert stats["grad_norm"] == pytest.approx(two_ranks["stats"]["grad_norm"], rel=1e-4)
    trained = [name for name in model.state_dict() if is_trainable(name)]
    assert sorted(trained) == sorted(two_ranks["adapters_1"])
    for name in trained:
        assert torch.allclose(model.state_dict()[name], two_ranks["adapters_1"][name],
                              atol=2e-5), name


def test_engine_adapter_fails_in_one_line_on_what_it_cannot_load():
    """generator/lora_adapter.EngineAdapter against stand-ins for vLLM's worker: an engine
    without LoRA, a vLLM without the private name it relies on, and an adapter of a module
    the engine does not adapt (vLLM's from_lora_tensors would drop it silently)."""
    from types import SimpleNamespace

    from llamarl.generator.lora_adapter import EngineAdapter, adapter_config, engine_lora_args

    # (also: config.VLLM_LORA_RANKS is the installed vLLM's list)
    assert engine_lora_args(4) == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    cfg = load_config(None, ["model.lora.rank=4", "model.lora.sync=adapters"])
    config, cpu = adapter_config(cfg.model.lora), torch.device("cpu")
    q = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    runner = SimpleNamespace()
    worker = SimpleNamespace(model_runner=runner)
    with pytest.raises(RuntimeError, match="built without LoRA"):
        EngineAdapter(worker, config, [q], cpu)
    runner.lora_manager = SimpleNamespace()
    with pytest.raises(RuntimeError, match=r"no WorkerLoRAManager\._adapter_manager.*"
                                           "model.lora.sync=merged") as e:
        EngineAdapter(worker, config, [q], cpu)
    assert "\n" not in str(e.value)
    runner.lora_manager._adapter_manager = SimpleNamespace(
        remove_adapter=None, add_adapter=None, activate_adapter=None, model=None, modules={},
        lora_config=SimpleNamespace(max_lora_rank=8, lora_dtype=torch.float32),
        supported_lora_modules=["qkv_proj", "o_proj"],
        packed_modules_mapping={"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    assert EngineAdapter(worker, config, [q], cpu).names == [q]
    with pytest.raises(ValueError, match="no LoRA layer for model.layers.0.mlp.up_proj"):
        EngineAdapter(worker, config, [q.replace("self_attn.q_proj", "mlp.up_proj")], cpu)


# adapter-only syncs need A and B alone: the recipe's trained final norm is left out
ADAPTER_SYNCS = ["model.lora.sync=adapters", "model.lora.modules_to_save=[]"]


@pytest.mark.slow
def test_adapter_syncs_end_to_end(tmp_path, cache_dir):
    """recipes/tiny_grpo_lora_cpu.yaml with model.lora.sync=adapters through the launcher,
    over the filesystem transport: the trainer ranks send the adapters alone (rank 8: 32768
    values, 64 KiB in float32 per trainer rank), and the engine, running the base model with
    vLLM's LoRA layers, samples with the trainer's policy at every step (kl_mis, the engine
    against the trainer per token: float rounding), once the adapters have moved away from
    B = 0 too. The run is then resumed: the engine gets the restored adapters before its
    first generation (an engine left at B = 0 would show in kl_mis). (The torch transport's
    adapter syncs: the continuous test below.)"""
    from conftest import torchrun
    from test_async_e2e import SMALL, metrics_of

    def launch(*extra):
        proc = torchrun(3, ["-m", "llamarl.launch", "recipes/tiny_grpo_lora_cpu.yaml",
                            *ADAPTER_SYNCS, "sync.transport=filesystem",
                            f"run.output_dir={tmp_path}", *SMALL, *extra],
                        timeout=600, LLAMARL_CACHE=cache_dir)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "0.06 MiB" in proc.stderr, proc.stderr[-3000:]
        return proc

    launch("run.steps=4", "run.checkpoint_every=4")
    assert "resumed from" in launch("run.steps=6", "run.resume=auto").stderr
    run, rows = metrics_of(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["mismatch_kl"] < 1e-6 for r in rows), [r["mismatch_kl"] for r in rows]
    assert rows[-1]["kl_ref"] > 1e-4, "the adapters moved: the policy is not the base"


@pytest.mark.slow
def test_adapter_syncs_in_continuous_generation(tmp_path, cache_dir):
    """Adapter-only syncs over the torch transport into an engine that generates
    continuously (in-flight updates, sync.max_staleness 1): every sync's adapters reach the
    engine (its loads, in the timeline), the samples are at most one version behind, as in
    merged mode, and those sampled with the trainer's current adapters have its logprobs."""
    from conftest import torchrun
    from test_async_e2e import SMALL, metrics_of

    proc = torchrun(3, ["-m", "llamarl.launch", "recipes/tiny_grpo_lora_cpu.yaml",
                        *ADAPTER_SYNCS, "generator.mode=continuous", "sync.max_staleness=1",
                        "run.steps=5", f"run.output_dir={tmp_path}", *SMALL],
                    timeout=600, LLAMARL_CACHE=cache_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run, rows = metrics_of(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["staleness_max"] <= 1 for r in rows), [r["staleness_max"] for r in rows]
    fresh = [r["mismatch_kl"] for r in rows if r["staleness_max"] == 0]
    assert fresh and max(fresh) < 1e-6, fresh  # on-policy rows: the engine is the trainer
    assert rows[-1]["kl_ref"] > 1e-4, "the adapters moved: the policy is not the base"
    from llamarl import timeline

    loaded = {r["step"] for r in timeline.read(run)
              if r["phase"] == "load_weights" and r["role"].startswith("generator")}
    assert set(range(5)) <= loaded, sorted(loaded)  # versions 0-4 (5 may come after the end)


@pytest.mark.slow
def test_the_lora_recipe_learns(tmp_path, cache_dir):
    """recipes/tiny_grpo_lora_cpu.yaml as written (rank-8 adapters and the final norm, a cosine
    schedule over 300 steps), stopped (RUN_DIR/stop) once its step-100 evaluation is written:
    held-out reward +0.15 by step 100 (measured, seeds 0-2 on the 2-core machine: +0.21,
    +0.30, +0.25 at step 100; +0.33, +0.37, +0.33 at 150 and +0.34, +0.39, +0.35 at 300, the
    recipe's claim, are left to docs/trainer.md's measurement to keep the suite short)."""
    import subprocess
    import sys
    import time

    from conftest import ROOT, child_env, complete_rows

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
           "-m", "llamarl.launch", "recipes/tiny_grpo_lora_cpu.yaml", "run.checkpoint_every=0",
           f"run.output_dir={tmp_path / 'out'}"]
    log = open(tmp_path / "job.log", "w+")  # a file: nobody reads a pipe while the test waits
    job = subprocess.Popen(cmd, cwd=ROOT, env=child_env(LLAMARL_CACHE=cache_dir), stdout=log,
                           stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 1200
        while job.poll() is None and time.monotonic() < deadline:
            runs = [p for p in (tmp_path / "out").glob("*") if p.is_dir()]
            evals = complete_rows(runs[0] / "eval.jsonl") if runs and (
                runs[0] / "eval.jsonl").exists() else []
            if any(e["step"] >= 100 for e in evals):
                (runs[0] / "stop").touch()
                break
            time.sleep(1)
        job.wait(timeout=300)
    finally:
        job.kill()
        log.close()
    out = (tmp_path / "job.log").read_text()
    assert job.returncode == 0, out[-4000:]
    (run,) = [p for p in (tmp_path / "out").iterdir() if p.is_dir()]
    evals = complete_rows(run / "eval.jsonl")
    rows = complete_rows(run / "metrics.jsonl")
    stopped = rows[-1]["step"]
    assert 100 < stopped < 300 and f"stopping at step {stopped} of 300" in out, out[-3000:]
    assert [e["step"] for e in evals] == [0, 50, 100, stopped]
    gain = evals[2]["reward_mean"] - evals[0]["reward_mean"]
    assert gain >= 0.15, [(e["step"], e["reward_mean"]) for e in evals]
    assert rows[-1]["elapsed_s"] < 300, rows[-1]["elapsed_s"]
