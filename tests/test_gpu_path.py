"""The GPU path, checked on the CPU against vLLM 0.32's own code (the CPU wheel's Python files
are the CUDA wheel's): where each engine's vLLM worker puts itself, whether the weight sync
fits what the recipe's gpu_memory_utilization leaves, the sampler's seeding (Model Runner
V2 draws request seeds from numpy), and the arguments a GPU engine gives vLLM.
(docs/generator.md, "The GPU path"; on a GPU: tests/test_gpu.py.)"""

from __future__ import annotations

import gc
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from llamarl.config import GeneratorConfig, load_config
from llamarl.generator.gpu_memory import (
    GIB,
    NCCL_COMM_BYTES,
    SYNC_MARGIN,
    check_sync_fits,
    later_bytes,
    model_bytes_from_config,
    reward_model_bytes,
    sync_need_bytes,
)
from llamarl.generator.kv_cache import kv_bytes_per_token, sequence_bytes
from llamarl.parallel.weight_plan import TensorMeta
from llamarl.runtime.gpus import (
    GPU_INDEX_ENV,
    VISIBLE,
    Placement,
    apply_placement,
    check_enough_gpus,
    check_mask_took_effect,
    check_placed,
    place,
    vllm_cache_root,
)
from llamarl.runtime.layout import compute_layout

ROOT = Path(__file__).resolve().parents[1]
GPU_RECIPES = sorted((ROOT / "recipes").glob("*gpu.yaml"))
H100 = int(79.6 * GIB)  # what an 80 GB H100 reports (torch.cuda.mem_get_info)
# vLLM's own use of its share beside the weights and the KV cache (activations of the profile
# run, CUDA graphs, the sampler): an allowance, not a measurement
VLLM_OVERHEAD = 4 * GIB

# The config.json of each GPU recipe's model (Qwen2.5 Instruct, as published), the fields the
# arithmetic reads: the recipes name models prepared on the cluster, not shipped here.
QWEN25 = {
    "Qwen2.5-0.5B-Instruct": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                  num_attention_heads=14, num_key_value_heads=2,
                                  vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-1.5B-Instruct": dict(hidden_size=1536, intermediate_size=8960,
                                  num_hidden_layers=28, num_attention_heads=12,
                                  num_key_value_heads=2, vocab_size=151936,
                                  tie_word_embeddings=True),
    "Qwen2.5-7B-Instruct": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                num_attention_heads=28, num_key_value_heads=4,
                                vocab_size=152064, tie_word_embeddings=False),
}


def recipe_config(recipe: Path, tmp_path: Path, *overrides: str):
    from test_config import stand_ins

    return load_config(recipe, stand_ins(recipe, tmp_path) + list(overrides))


def model_config(cfg) -> dict:
    name = Path(cfg.model.path).name
    return {"model_type": "qwen2", "max_position_embeddings": 32768, **QWEN25[name]}


# -- placement ---------------------------------------------------------------------------------

def vllm_device(tp: int, environ: dict) -> str:
    """The physical GPU vLLM 0.32's worker of a generator process with `environ` picks, by
    vLLM's own code: the executor's _distributed_args (tp 1: UniProcExecutor, from the
    device string DeviceConfig makes, a bare `cuda`; tp > 1: the external launcher, from
    LOCAL_RANK), then gpu_worker.init_device's bound check and its logical -> visible ->
    physical mapping under CUDA_VISIBLE_DEVICES."""
    from vllm.config.device import DeviceConfig
    from vllm.platforms.interface import Platform
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher, UniProcExecutor

    class Cuda(Platform):  # CudaPlatform's device-id mapping (its own module needs CUDA)
        device_control_env_var = "CUDA_VISIBLE_DEVICES"

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(environ)
    try:
        if tp == 1:
            stub = SimpleNamespace(vllm_config=SimpleNamespace(
                device_config=DeviceConfig(device="cuda")))
            _, _, local_rank = UniProcExecutor._distributed_args(stub)
        else:
            _, _, local_rank = ExecutorWithExternalLauncher._distributed_args(None)
        visible = environ[VISIBLE].split(",")
        assert local_rank < len(visible), "vLLM: local rank out of bounds for the devices"
        index = Cuda.logical_device_id_to_visible_device_id(local_rank)
        return visible[index]
    finally:
        os.environ.clear()
        os.environ.update(saved)


def generator_env(layout, rank: int, local_rank: int, node_visible: str) -> tuple[dict, object]:
    """The environment a generator rank hands vLLM: runtime/gpus.py's placement, then
    engine.prepare_environment (tp 1 drops LOCAL_RANK; tp > 1 sets it to the EngineWorld's
    local rank, which generator/loop.py takes from the rank's device index)."""
    env = {VISIBLE: node_visible}
    placement = apply_placement(layout, rank, local_rank, env)
    if layout.tp > 1:
        env.update(RANK=str(layout.role_of(rank).tp_rank), LOCAL_RANK=str(placement.index))
    return env, placement


LAUNCHES = [(recipe, launch, tp) for recipe in GPU_RECIPES for launch in ("torchrun", "slurm")
            for tp in (1, 2)]


@pytest.mark.parametrize("recipe,launch,tp", LAUNCHES,
                         ids=[f"{r.stem}-{launch}-tp{tp}" for r, launch, tp in LAUNCHES])
def test_every_engine_runs_on_its_ranks_own_gpu(recipe, launch, tp, tmp_path):
    """8 GPUs a node. torchrun: every rank sees the node's 8 GPUs and owns GPU local_rank.
    slurm: each task sees only its own GPU (--gpus-per-task=1). Each engine's vLLM worker must
    land on the GPU its rank owns, never on a trainer's or another engine's."""
    cfg = recipe_config(recipe, tmp_path)
    engines = cfg.generator.engines // tp  # the same GPUs, as engines of tp GPUs
    cfg = recipe_config(recipe, tmp_path, f"generator.tp={tp}", f"generator.engines={engines}")
    per_node = 8
    world = cfg.trainer.ranks + cfg.generator.engines * tp
    layout = compute_layout(world, per_node, cfg.trainer.ranks, cfg.generator.engines, tp)
    used: dict[tuple[int, str], int] = {}
    for rank in range(world):
        node, local = divmod(rank, per_node)
        own = str(local)  # the node's GPU this rank owns
        node_visible = own if launch == "slurm" else ",".join(map(str, range(per_node)))
        role = layout.role_of(rank)
        if role.role == "trainer":
            placement = apply_placement(layout, rank, local, {VISIBLE: node_visible})
            gpu = node_visible.split(",")[placement.index]
        else:
            env, placement = generator_env(layout, rank, local, node_visible)
            gpu = vllm_device(tp, env)
            assert placement.sees_engine == (launch == "torchrun" or tp == 1)
        assert gpu == own, (rank, role.name, gpu, own)
        assert (node, gpu) not in used, f"rank {rank} shares GPU {gpu} with rank {used[node, gpu]}"
        used[node, gpu] = rank


def test_placement_is_made_once_and_inherited():
    """A process started by a placed one (a supervised engine, a replacement's tp ranks) keeps
    its parent's placement: its CUDA_VISIBLE_DEVICES already names the engine's GPU alone."""
    layout = compute_layout(8, 8, 4, 4, 1)
    env = {VISIBLE: "0,1,2,3,4,5,6,7"}
    first = apply_placement(layout, 6, 6, env)
    assert env[VISIBLE] == "6" and env[GPU_INDEX_ENV] == "0" and first.index == 0
    again = apply_placement(layout, 6, 6, env)
    assert env[VISIBLE] == "6" and again.index == 0
    assert env["VLLM_CACHE_ROOT"].endswith("llamarl-engine2"), "a compile cache per engine"


def test_no_gpu_no_placement(monkeypatch):
    monkeypatch.delenv(VISIBLE, raising=False)
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: False)
    env: dict = {}
    assert apply_placement(compute_layout(3, 3, 2, 1, 1), 2, 2, env) is None and env == {}


def test_a_node_short_of_gpus_is_one_line_before_anything_loads():
    """8 ranks a node on a node that shows 6 GPUs: place() used to wrap ranks 6 and 7 onto
    GPUs 0 and 1 (a trainer's); now every rank's placement says so, naming the counts."""
    layout = compute_layout(16, 8, 8, 8, 1)
    six = [str(g) for g in range(6)]
    for rank in (0, 6, 15):
        with pytest.raises(ValueError) as e:
            place(layout, rank, rank % 8, six)
        line = str(e.value)
        assert "\n" not in line and f"rank {rank} on node {rank // 8}:" in line, line
        assert "8 ranks a node but the node shows 6 GPUs" in line, line
        assert "--nproc-per-node 6" in line, line
    check_enough_gpus(layout, 9, [str(g) for g in range(8)])  # enough: no error
    # one GPU shown: Slurm's --gpus-per-task=1 (each task its own), or a one-GPU machine
    # shared by a trainer and an engine on purpose
    assert place(layout, 9, 1, ["5"]).index == 0
    assert place(compute_layout(2, 2, 1, 1, 1), 1, 1, ["0"]).index == 0


def test_a_mask_cuda_ignored_is_one_line():
    """NVML failed, so counting the GPUs started CUDA and the engine's mask is ignored: CUDA
    shows all 8 GPUs where the mask names 1 (vLLM would take GPU 0)."""
    with pytest.raises(RuntimeError) as e:
        check_mask_took_effect(11, 1, "3", 8)
    line = str(e.value)
    assert "\n" not in line, line
    assert line.startswith("rank 11 on node 1: placed on GPU(s) CUDA_VISIBLE_DEVICES=3 (1) "
                           "but CUDA shows it 8"), line
    check_mask_took_effect(11, 1, "3", 1)
    check_mask_took_effect(4, 0, "4,5", 2)
    with pytest.raises(RuntimeError, match="rank 11 on node 1"):
        check_placed(Placement("3", 0), 11, 1, 8)
    check_placed(Placement("3", 0), 11, 1, 0)  # a torch without CUDA: a CPU run
    check_placed(Placement(None, 3), 3, 0, 8)  # a trainer: no mask of its own
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES=4,5 \\(2\\) but CUDA shows it 1"):
        check_mask_took_effect(4, 0, "4,5", 1)


def test_the_engines_compile_cache_root_is_vllms_own():
    """vLLM's default cache root (vllm/envs.py): VLLM_CACHE_ROOT, else $XDG_CACHE_HOME/vllm,
    else ~/.cache/vllm; each engine's directory goes under it."""
    home = str(Path.home())
    assert vllm_cache_root({}) == f"{home}/.cache/vllm"
    assert vllm_cache_root({"XDG_CACHE_HOME": "/scratch/c"}) == "/scratch/c/vllm"
    assert vllm_cache_root({"XDG_CACHE_HOME": "/scratch/c", "VLLM_CACHE_ROOT": "/v"}) == "/v"
    assert vllm_cache_root({"VLLM_CACHE_ROOT": "~/v"}) == f"{home}/v"
    env = {VISIBLE: "0,1,2,3", "XDG_CACHE_HOME": "/scratch/c"}
    apply_placement(compute_layout(4, 4, 2, 2, 1), 3, 3, env)
    assert env["VLLM_CACHE_ROOT"] == "/scratch/c/vllm/llamarl-engine1"


# -- memory ------------------------------------------------------------------------------------

def sync_metas(config: dict, senders: int) -> list[list[TensorMeta]]:
    """The shard layouts T FSDP2 trainer ranks publish for a Qwen2 model: every tensor's rows
    split over the senders (Shard(0)), in bf16."""
    h, v, inter = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    head_dim = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.q_proj.bias": (q,),
                       p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
                       p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter),
                       p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    out = []
    for r in range(senders):
        metas = []
        for name, shape in shapes.items():
            rows = math.ceil(shape[0] / senders)
            row0 = min(r * rows, shape[0])
            n = min(rows, shape[0] - row0)
            if n > 0:
                metas.append(TensorMeta(name, "torch.bfloat16", shape, n, row0))
        out.append(metas)
    return out


def largest_call(cfg) -> int:
    """generator/loop.largest_call's arithmetic for a recipe."""
    g, engines = cfg.generator, cfg.generator.engines
    train = g.prompts_per_step // engines * g.samples_per_prompt
    if g.mode == "continuous":
        train = g.in_flight_sequences or train
    return max(train, -(-cfg.data.eval_prompts // engines) * cfg.data.eval_samples_per_prompt)


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=[r.stem for r in GPU_RECIPES])
def test_every_gpu_recipe_fits_an_80gb_gpu(recipe, tmp_path):
    """What vLLM leaves free under the recipe's gpu_memory_utilization holds the weight
    sync's peak (receive buffers + the first sync's assembled tensors), and vLLM's share
    holds the weights, its overhead and the KV cache of the largest generate call."""
    cfg = recipe_config(recipe, tmp_path)
    config = model_config(cfg)
    model = model_bytes_from_config(config)
    metas = sync_metas(config, cfg.trainer.ranks)
    need = sync_need_bytes(metas)
    assert sum(m.numel for ms in metas for m in ms) * 2 == model  # the two counts agree
    assert need == (2 * model if cfg.trainer.ranks > 1 else model)
    u = cfg.generator.gpu_memory_utilization
    check_sync_fits(need, int((1 - u) * H100), H100, u, cfg.trainer.ranks)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    per_token = kv_bytes_per_token(tmp_path / "m", "bfloat16", cfg.generator.tp)
    kv_need = largest_call(cfg) * sequence_bytes(cfg.generator.max_model_len, 16, per_token)
    kv_room = u * H100 - model - VLLM_OVERHEAD
    assert kv_need <= kv_room, (kv_need / GIB, kv_room / GIB)


def test_the_startup_check_fires_on_a_recipe_that_does_not_fit(tmp_path):
    """The 7B recipe as it was (gpu_memory_utilization 0.85): 8 senders' shards of 14.2 GiB
    and the first sync's 14.2 GiB more, against the 11.9 GiB vLLM leaves. One line naming the
    key and a value that fits, which does fit."""
    recipe = ROOT / "recipes" / "qwen2.5_7b_ppo_gsm8k_2x8gpu.yaml"
    cfg = recipe_config(recipe, tmp_path, "generator.gpu_memory_utilization=0.85")
    need = sync_need_bytes(sync_metas(model_config(cfg), cfg.trainer.ranks))
    with pytest.raises(ValueError) as e:
        check_sync_fits(need, int(0.15 * H100), H100, 0.85, 8)
    line = str(e.value)
    assert "\n" not in line and "generator.gpu_memory_utilization=0.85" in line
    fits = float(line.split("set generator.gpu_memory_utilization=")[1].split()[0])
    assert 0.4 < fits < 0.85
    check_sync_fits(need, int((1 - fits) * H100), H100, fits, 8)
    with pytest.raises(ValueError, match="kv_cache_gib=20: set generator.kv_cache_gib=2.56"):
        check_sync_fits(need, int(0.15 * H100), H100, 0.85, 8, kv_cache_gib=20)
    assert need + SYNC_MARGIN > 0.15 * H100


def test_sync_need_of_a_pool_and_of_slices_by_hand():
    """Five float32 tensors of 10, 2, 3, 25 and 1 elements, a bucket each (bucket_mb 0):
    a buffer per bucket is 164 bytes; a pool of 2 takes them in turn, slots 0, 1, 0, 1, 0,
    each as large as its largest: 40 + 100. Several senders, or a resharded tp 2 engine
    (164 + slices of 164 / 2), keep a buffer per bucket; so do adapters."""
    metas = [[TensorMeta(f"w{i}", "torch.float32", (n,)) for i, n in
              enumerate((10, 2, 3, 25, 1))]]
    assert sync_need_bytes(metas, 0) == 164
    assert sync_need_bytes(metas, 0, receive_buffers=2) == 140
    assert sync_need_bytes(metas, 0, receive_buffers=8) == 164
    assert sync_need_bytes(metas, 0, receive_buffers=2, tp=2, reshard=True) == 164 + 82
    assert sync_need_bytes(metas, 0, receive_buffers=2, tp=2, reshard=False) == 140
    assert sync_need_bytes(metas, 0, receive_buffers=2, adapters=True) == 164
    split = [[TensorMeta("w", "torch.float32", (4, 3), 2, 2 * s)] for s in range(2)]
    assert sync_need_bytes(split, 0, receive_buffers=2) == 2 * 24 + 48  # + put together


def test_the_check_counts_communicators_and_a_reward_model_after_it():
    """1 GiB of sync, then 4 communicators (4 x NCCL_COMM_BYTES) and a 2 GiB reward model,
    plus the margin: one line naming each and the value of the key that fits."""
    later = later_bytes(4, 2 * GIB)
    assert sum(later.values()) == 4 * NCCL_COMM_BYTES + 2 * GIB
    total = GIB + 4 * NCCL_COMM_BYTES + 2 * GIB + SYNC_MARGIN
    check_sync_fits(GIB, total, 10 * total, 0.5, 1, later=later)  # exactly fits
    with pytest.raises(ValueError) as e:
        check_sync_fits(GIB, total - GIB, 10 * total, 0.5, 1, later=later)
    line = str(e.value)
    assert "\n" not in line and "needs 1 GiB" in line, line
    assert f"4 NCCL communicator(s) at {NCCL_COMM_BYTES >> 20} MiB" in line
    assert "the reward model (reward.model_placement generator) (2 GiB)" in line
    # 1 GiB short on a card of 10 x 6 GiB: 0.5 - 1/60 = 0.483, in hundredths down
    assert NCCL_COMM_BYTES == 512 << 20 and total == 6 * GIB
    assert "set generator.gpu_memory_utilization=0.48 or lower" in line
    assert later_bytes(0) == {}


def test_reward_model_bytes_are_its_weight_files(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "config.json").write_text("{}")
    assert reward_model_bytes(str(tmp_path)) == 1000
    assert reward_model_bytes(str(tmp_path / "absent")) == 0


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=[r.stem for r in GPU_RECIPES])
def test_every_gpu_recipe_fits_with_its_communicators(recipe, tmp_path):
    """The engine ranks' NCCL communicators from the job's own plan (parallel/plan.py), at
    NCCL_COMM_BYTES each, fit beside the sync under the recipe's utilization."""
    from llamarl.parallel.plan import comm_plan

    cfg = recipe_config(recipe, tmp_path)
    g = cfg.generator
    world = cfg.trainer.ranks + g.engines * g.tp
    layout = compute_layout(world, min(world, 8), cfg.trainer.ranks, g.engines, g.tp)
    plan = comm_plan(cfg, layout, "nccl")
    comms = max(len(plan.gpu_communicators(r)) for r in layout.generator_global_ranks)
    need = sync_need_bytes(sync_metas(model_config(cfg), cfg.trainer.ranks), cfg.sync.bucket_mb,
                           cfg.sync.solo_mb, cfg.sync.receive_buffers, g.tp, cfg.sync.reshard)
    u = g.gpu_memory_utilization
    check_sync_fits(need, int((1 - u) * H100), H100, u, cfg.trainer.ranks,
                    later=later_bytes(comms))


def test_sync_need_counts_buffers_and_assembled_tensors():
    whole = TensorMeta("norm", "torch.float32", (8,))
    split = [TensorMeta("w", "torch.bfloat16", (6, 4), 3, 0), TensorMeta("w", "torch.bfloat16",
                                                                         (6, 4), 3, 3)]
    assert sync_need_bytes([[whole, split[0]], [split[1]]]) == 8 * 4 + 24 * 2 + 24 * 2


# -- sampler seeds -----------------------------------------------------------------------------

def test_the_sampler_seed_covers_numpy():
    """vLLM 0.32's Model Runner V2 (CUDA with Triton) gives each request without a seed one
    from np.random.randint as it is added (v1/worker/gpu/sample/states.py): seeding the
    sampler must seed numpy's global generator too, and torch's."""
    from vllm.v1.worker.gpu.sample import states  # noqa: F401 - the module that draws them

    from llamarl.generator.worker_ext import LlamarlWorkerExtension

    seed = (1 << 62) + 12345  # sampler_seed's 63 bits
    draws = []
    for _ in range(2):
        np.random.seed(0)
        torch.manual_seed(0)
        LlamarlWorkerExtension.llamarl_seed_sampler(None, seed)
        draws.append((np.random.randint(-(2**63), 2**63 - 1), torch.rand(1).item()))
    assert draws[0] == draws[1]
    np.random.seed(seed % 2**32)
    assert draws[0][0] == np.random.randint(-(2**63), 2**63 - 1)


# -- the engine's vLLM arguments on GPU --------------------------------------------------------

class FakeLLM:
    """Stands in for vllm.LLM on the CPU to see what a GPU engine asks of it (the real GPU
    engine: tests/test_gpu.py). Its cache config says what vLLM 0.32 decides on a GPU: the
    attention backend's block size (here 32) and the blocks it allocated."""

    made: list[dict] = []

    def __init__(self, **kwargs):
        FakeLLM.made.append(kwargs)
        cache = SimpleNamespace(block_size=32, num_gpu_blocks=1000)
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache))

    def get_tokenizer(self):
        return None

    def collective_rpc(self, method, args=()):
        return [SimpleNamespace(model_runner=None)]


@pytest.fixture
def fake_vllm(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    # the engine sets what vLLM reads in os.environ: put it back afterwards
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL", "RANK", "WORLD_SIZE",
                "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_USE_AGENT_STORE"):
        present = key in os.environ
        monkeypatch.setenv(key, os.environ.get(key, ""))
        if not present:
            monkeypatch.delenv(key)
    FakeLLM.made = []
    yield FakeLLM
    gc.unfreeze()


def test_gpu_engine_turns_async_scheduling_off_and_reads_the_block_size(fake_vllm,
                                                                        tiny_model_dir):
    from llamarl.generator.engine import Engine

    cfg = GeneratorConfig(max_model_len=64, prompts_per_step=4, samples_per_prompt=2)
    engine = Engine(str(tiny_model_dir), cfg, "bfloat16", 0, on_cpu=False)
    (kwargs,) = fake_vllm.made
    assert kwargs["async_scheduling"] is False
    assert kwargs["gpu_memory_utilization"] == cfg.gpu_memory_utilization
    assert "disable_custom_all_reduce" not in kwargs
    assert engine.block_size == 32, "the block size vLLM chose, not a default"
    assert engine.kv.cache_bytes == 1000 * 32 * engine.bytes_per_token


def test_gpu_engine_kv_cache_of_the_recipes_size(fake_vllm, tiny_model_dir):
    from llamarl.generator.engine import Engine

    cfg = GeneratorConfig(max_model_len=64, kv_cache_gib=0.5)
    Engine(str(tiny_model_dir), cfg, "bfloat16", 0, on_cpu=False)
    (kwargs,) = fake_vllm.made
    assert kwargs["kv_cache_memory_bytes"] == GIB // 2 and "gpu_memory_utilization" not in kwargs


class FailingLLM:
    """vllm.LLM failing as vLLM 0.32 does on a GPU short of KV cache: after its executor chose
    the attention backend's block size (32 here) in the VllmConfig its frames hold."""

    def __init__(self, **kwargs):
        from vllm.config import CacheConfig

        vllm_config = SimpleNamespace(cache_config=CacheConfig(block_size=32))
        assert vllm_config.cache_config.block_size == 32
        raise ValueError("No available memory for the cache blocks. Try increasing "
                         "`gpu_memory_utilization` when initializing the engine.")


@pytest.mark.parametrize("extra,key,block", [
    ({}, "generator.gpu_memory_utilization", 32),  # vLLM's choice, read off the failure
    ({"kv_cache_gib": 0.5}, "generator.kv_cache_gib", 32),
    ({"block_size": 64}, "generator.gpu_memory_utilization", 64),  # the recipe's, vLLM takes it
])
def test_a_gpu_engine_short_of_kv_cache_names_the_key_that_sizes_it(
        fake_vllm, monkeypatch, tiny_model_dir, extra, key, block):
    import vllm

    from llamarl.generator.engine import Engine

    monkeypatch.setattr(vllm, "LLM", FailingLLM)
    cfg = GeneratorConfig(max_model_len=48, prompts_per_step=4, samples_per_prompt=2, **extra)
    with pytest.raises(RuntimeError) as e:
        Engine(str(tiny_model_dir), cfg, "bfloat16", 0, on_cpu=False)
    per_token = kv_bytes_per_token(tiny_model_dir, "bfloat16")
    # 8 sequences of 48 tokens in whole blocks: 2 blocks of 32 (64 tokens) or 1 of 64; the
    # old 16-token count said 48
    need = 8 * (64 if block in (32, 64) else 48) * per_token / GIB
    line = str(e.value)
    assert f"needs {need:.3g} GiB; raise {key}," in line, line


def test_kv_cache_key_and_failed_block_size():
    from llamarl.generator.engine import failed_block_size, kv_cache_key

    assert kv_cache_key(False, 0.0) == "generator.gpu_memory_utilization"
    assert kv_cache_key(False, 20.0) == "generator.kv_cache_gib"
    assert kv_cache_key(True, 0.0) == "generator.kv_cache_gib"
    try:
        FailingLLM()
    except ValueError as e:
        assert failed_block_size(e, 0, 16) == 32
        assert failed_block_size(e, 48, 16) == 48
    try:
        raise ValueError("out of memory")  # no VllmConfig in the frames: vLLM's default
    except ValueError as e:
        assert failed_block_size(e, 0, 16) == 16


def test_gpu_engine_args_where_tp_ranks_see_one_gpu_each():
    from llamarl.generator.engine import EngineWorld, gpu_engine_args

    world = EngineWorld(1, 2, "127.0.0.1", 1, 0, peers_visible=False)
    assert gpu_engine_args(world) == {"async_scheduling": False,
                                      "disable_custom_all_reduce": True}
    assert gpu_engine_args(EngineWorld(1, 2, "127.0.0.1", 1, 1)) == {"async_scheduling": False}


def test_another_vllm_version_is_said_at_start():
    from llamarl.generator.engine import VLLM_VERSION, vllm_version_warning

    assert vllm_version_warning(VLLM_VERSION) is None
    assert vllm_version_warning(VLLM_VERSION + "+cpu") is None
    line = vllm_version_warning("0.33.0")
    assert "0.33.0" in line and f"vllm=={VLLM_VERSION}" in line and "\n" not in line
    import vllm

    assert vllm_version_warning(vllm.__version__) is None, "this machine runs another vLLM"


def test_a_placed_replacements_tp_ranks_each_take_their_own_gpu(monkeypatch):
    """A supervisor's replacement of a tp 2 engine (on GPU: placed, it sees the engine's two
    GPUs) starts its tp rank 1 with device index 1, not its own 0; one that sees a single GPU
    is a one-line error."""
    import subprocess

    from llamarl.launch import join
    from llamarl.runtime.dist_env import DistEnv

    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, env, **kw: started.append(env))
    layout = compute_layout(8, 8, 4, 2, 2)
    env = DistEnv(6, 8, 6, 8, "127.0.0.1", 1, "torchrun")
    monkeypatch.setenv(VISIBLE, "6,7")
    monkeypatch.setenv(GPU_INDEX_ENV, "0")
    join.spawn_tp_ranks(layout, env, "1", ["--join", "run"])
    assert [e[GPU_INDEX_ENV] for e in started] == ["1"] and started[0][VISIBLE] == "6,7"
    monkeypatch.setenv(VISIBLE, "6")
    with pytest.raises(ValueError, match="sees 1 GPU"):
        join.spawn_tp_ranks(layout, env, "1", ["--join", "run"])


def test_the_launch_stops_with_one_line_on_a_node_short_of_gpus(tmp_path):
    """python -m llamarl.launch, 3 ranks a node on a node that shows 2 GPUs: one line from
    local rank 0 and exit 2 at placement, before any store, model or engine (no GPU needed:
    CUDA_VISIBLE_DEVICES names the node's GPUs)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(root), "RANK": "0", "WORLD_SIZE": "3",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1", "CUDA_VISIBLE_DEVICES": "0,1", "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "llamarl.launch",
                           str(root / "recipes" / "tiny_grpo_cpu.yaml"), "trainer.ranks=2",
                           f"run.output_dir={tmp_path}"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert lines == ["llamarl: error: rank 0 on node 0: 3 ranks a node but the node shows 2 "
                     "GPUs (CUDA_VISIBLE_DEVICES=0,1); each rank needs a GPU of its own: launch "
                     "--nproc-per-node 2 per node (with trainer.ranks and generator.engines x "
                     "generator.tp to match), show the node 3 GPUs, or hide them "
                     "(CUDA_VISIBLE_DEVICES=) to run on the CPU"], lines
