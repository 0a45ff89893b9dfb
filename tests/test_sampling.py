"""Sampling randomness, the KV cache sized from the workload, and threads per role.

The real-engine test drives vLLM (tiny model) through a batch that needs chunked prefills and
preemption; on the code before the sampler seeding fix it either crashed ('CPU Generator does not
use offset') or returned identical groups for a prompt placed twice in one batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import DIST, ROOT, child_env, rank_line, torchrun

from llamarl.config import load_config
from llamarl.generator.engine import sampler_seed
from llamarl.generator.kv_cache import (
    GIB,
    check_block_size,
    default_block_size,
    kv_bytes_per_token,
    plan_kv_cache,
)
from llamarl.runtime.cores import SPIN_ENV, release_cores_promptly, threads_for
from llamarl.runtime.layout import compute_layout

RECIPE = "recipes/tiny_grpo_cpu.yaml"


def test_sampler_seeds_differ_for_every_call_and_run():
    calls = [(run, purpose, step, engine, rnd) for run in (0, 1) for purpose in ("train", "eval")
             for step in range(50) for engine in range(4) for rnd in range(3)]
    seeds = {sampler_seed(*c) for c in calls}
    assert len(seeds) == len(calls)
    assert all(0 <= s < 2**63 for s in seeds)
    assert sampler_seed(3, "train", 7, 1) == sampler_seed(3, "train", 7, 1)  # deterministic


def test_engine_samples_independently_and_survives_preemption(tiny_model_dir, tmp_path):
    """384 sequences in a KV cache that holds 163 at full length, 23k prompt tokens against a
    4096-token step budget: vLLM chunks prefills and preempts (counted in its scheduler).
    The engine leaves nothing in the temporary directory (vLLM's FileStore of its one-rank
    process group stayed behind before)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run([sys.executable, str(DIST / "engine_sampling.py"), str(tiny_model_dir),
                           "0.02"], cwd=ROOT, env=child_env(OMP_NUM_THREADS=2, TMPDIR=tmp),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(tmp.glob("vllm_dist_*")), list(tmp.iterdir())
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["preemptions"] > 0, out
    assert "will preempt" in out["kv"] and "generator.kv_cache_gib=0.05" in out["kv"], out["kv"]
    assert out["groups"] == 48 and out["sizes"] == [8] and out["lengths_ok"] and out["logprobs_ok"]
    # the same prompt twice in one batch: two independent groups, not one group twice
    assert out["duplicate_prompt_identical"] == 0, out
    assert out["first_token_agree"] <= 3, out  # ~0.2 expected by chance over a 45-token vocab
    assert out["distinct_in_group0"] == 8, out
    # deterministic in the seed, preemption included; another seed, other samples
    assert out["same_seed_identical"] and not out["other_seed_identical"], out
    assert out["store_files"] == [], out["store_files"]  # none while the engine runs either
    # the sampled tokens' logprobs read off the sampler are vLLM's own, bit for bit
    assert out["sampler_logprobs_equal_vllm"] and out["greedy_logprobs_equal_vllm"], out


def test_kv_bytes_per_token_from_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
        "hidden_size": 512}))
    # the 24M Qwen2 of the KV-preemption issue: 2 x 8 layers x 2 heads x 64 x 4 bytes = 8 KiB
    assert kv_bytes_per_token(tmp_path, "float32") == 8192
    assert kv_bytes_per_token(tmp_path, "bfloat16", tp=2) == 2048


def test_auto_kv_cache_holds_the_batch_within_the_host_bound():
    # 512 sequences x 160 tokens (two 128-token blocks each) x 8 KiB
    plan = plan_kv_cache(8192, 512, 160, 128, 0.0, available=16 * GIB)
    assert plan.auto and plan.need_bytes == 512 * 256 * 8192 and plan.cache_bytes == plan.need_bytes
    assert plan.fits == 512 and "preempt" not in plan.describe()
    small = plan_kv_cache(8192, 512, 160, 128, 0.0, engines_on_host=2, available=2 * GIB)
    assert small.cache_bytes == GIB // 2 and small.fits == 256
    assert "holds 256 of them" in small.describe() and "kv_cache_gib=1" in small.describe()


def test_auto_block_size_lets_a_group_share_its_prompt_on_cpu():
    """generator.block_size = 0: CPU sequences of 128 tokens or more get 32-token blocks (the
    prefix cache shares whole blocks only: a group's samples then share their prompt's first
    blocks), the tiny recipes' 64-token sequences vLLM's 128, the GPU vLLM's 16."""
    assert default_block_size(True, 128) == 32 and default_block_size(True, 320) == 32
    assert default_block_size(True, 64) == 128
    assert default_block_size(False, 128) == 16 and default_block_size(False, 64) == 16


def test_cpu_block_size_not_a_multiple_of_32_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"generator.block_size=16: vLLM's CPU attention takes "
                                         r"multiples of 32 tokens; set 32"):
        check_block_size(16, on_cpu=True)
    check_block_size(16, on_cpu=False)
    check_block_size(0, on_cpu=True)
    check_block_size(64, on_cpu=True)


def test_kv_cache_too_small_for_one_sequence_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"generator.kv_cache_gib = 0.001 holds less than one "
                                         r"sequence .* raise it to at least"):
        plan_kv_cache(8192, 512, 160, 128, 0.001)
    with pytest.raises(ValueError, match="too little for the KV cache of even one sequence"):
        plan_kv_cache(8192, 512, 160, 128, 0.0, available=1 << 20)


def test_explicit_kv_cache_below_a_batch_warns_with_the_size_needed():
    plan = plan_kv_cache(8192, 512, 160, 128, 0.25)
    assert not plan.auto and plan.fits == 128
    assert "vLLM will preempt" in plan.describe() and "kv_cache_gib=1.0" in plan.describe()


def _threads(overrides, cores=2, world=3, per_node=3):
    cfg = load_config(RECIPE, overrides)
    layout = compute_layout(world, per_node, cfg.trainer.ranks, cfg.generator.engines, 1)
    return [threads_for(cfg, layout, r, cores) for r in range(world)]


def test_on_policy_the_running_role_gets_the_cores():
    assert _threads([]) == [1, 1, 2]  # 2 trainers share 2 cores; the engine gets both
    assert _threads([], cores=16) == [8, 8, 16]
    assert _threads(["trainer.ranks=1", "generator.engines=2"], cores=16) == [16, 8, 8]


def test_overlapping_roles_share_the_cores_and_explicit_counts_win():
    assert _threads(["sync.max_staleness=1"], cores=16) == [5, 5, 5]
    assert _threads(["sync.max_staleness=1"]) == [1, 1, 1]
    assert _threads(["generator.threads=3", "trainer.threads=4"]) == [4, 4, 3]
    # two nodes of 3 ranks (4 trainers, 2 engines): counted per node
    cfg = ["trainer.ranks=4", "generator.engines=2", "generator.prompts_per_step=8"]
    assert _threads(cfg, cores=12, world=6, per_node=3) == [4, 4, 4, 12, 6, 6]


# A run with a KV cache smaller than a batch completes: tests/test_docs_examples.py (in the
# same launch as the docs' examples).


@pytest.mark.slow
def test_kv_cache_below_one_sequence_stops_the_run_in_one_line(tmp_path, cache_dir):
    t0 = time.monotonic()
    proc = torchrun(3, ["-m", "llamarl.launch", RECIPE, f"run.output_dir={tmp_path}",
                        "generator.prompts_per_step=8", "generator.kv_cache_gib=0.00001"],
                    timeout=300, LLAMARL_CACHE=cache_dir)
    assert proc.returncode != 0 and time.monotonic() - t0 < 120
    line = rank_line(proc.stderr, "rank 2 (generator 0)")
    assert line is not None, proc.stderr[-4000:]
    assert "generator.kv_cache_gib = 1e-05 holds less than one sequence" in line, line


def test_prefix_cache_off_where_no_block_can_fill_changes_no_sample(tiny_model_dir):
    """max_model_len 64 under 128-token CPU blocks (the tiny recipes): vLLM's prefix cache can
    never hit, so the engine turns it off; the samples and logprobs equal those of an engine
    with the cache forced on, over three seeded calls."""
    proc = subprocess.run([sys.executable, str(DIST / "engine_prefix_cache.py"),
                           str(tiny_model_dir)], cwd=ROOT, env=child_env(OMP_NUM_THREADS=1),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not out["auto_prefix_caching"] and out["cached_prefix_caching"], out
    assert out["same_samples"] and out["tokens"] > 16 * 8 * 3, out


def _spin_after_parallel_op(env: dict) -> float:
    """CPU milliseconds a 2-thread process burns while its main thread sleeps 200 ms right
    after a parallel operation: the OpenMP worker's spin before it sleeps."""
    code = ("import time, torch; torch.set_num_threads(2); x = torch.randn(4_000_000)\n"
            "burnt = []\n"
            "for _ in range(5):\n"
            "    x.mul_(1.0000001); c = time.process_time(); time.sleep(0.2)\n"
            "    burnt.append(time.process_time() - c)\n"
            "print(sorted(burnt)[2] * 1000)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip())


def test_idle_openmp_threads_let_go_of_the_core_within_a_few_ms(monkeypatch):
    """The launcher's spin setting (runtime/cores.py) makes torch's OpenMP worker sleep ~1 ms
    after its work instead of spinning on the core the other role needs: measured, not only
    set. A value the user set is kept."""
    for key in SPIN_ENV:  # (setenv first: the test's changes are undone after it)
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    default = _spin_after_parallel_op(dict(os.environ))
    release_cores_promptly()
    assert {k: os.environ[k] for k in SPIN_ENV} == SPIN_ENV
    released = _spin_after_parallel_op(dict(os.environ))
    assert released < 4.0 and released < default / 2, (released, default)
    monkeypatch.setenv("GOMP_SPINCOUNT", "INFINITE")
    release_cores_promptly()
    assert os.environ["GOMP_SPINCOUNT"] == "INFINITE"
