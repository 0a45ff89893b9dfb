"""bench/weight_sync_model.py: the sync-time estimate's terms by hand-computed values, and its
`one` scheme (trainers all-gather each bucket, trainer 0 alone broadcasts it to every engine
GPU) within 1.5x of one NIC's bound B / beta at the issue's four layouts, at the central point
of the public figures (a CI-fast check: no process, no transfer)."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def model():
    sys.path.insert(0, str(BENCH))  # the bench imports harness from its own directory
    try:
        spec = importlib.util.spec_from_file_location("weight_sync_model",
                                                      BENCH / "weight_sync_model.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["weight_sync_model"] = module  # its dataclasses look themselves up there
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop("weight_sync_model", None)


def test_qwen_7b_bytes_and_the_plans_messages(model):
    assert model.model_bytes() == 15_231_233_024  # 7.62e9 bf16 parameters
    # T = 32: gate, up, down of 28 layers (4.2 MB shards) and the two embeddings (34 MB)
    # alone, the attention shards (< 1 MiB) in one 64 MiB bucket
    assert len(model.sender_messages(32)) == 28 * 3 + 2 + 1
    # T = 256: only the embeddings' shards (4.3 MB) reach 1 MiB; the rest is one bucket
    assert len(model.sender_messages(256)) == 3
    assert sum(model.sender_messages(1)) == model.model_bytes()


def test_ring_fill_and_hops_by_hand(model):
    link = model.Link(beta=25e9, t_chunk=30e-6, delta=20e-6, hops="nodes")
    step = (1 << 19) / 25e9  # a 512 KiB chunk at 25 GB/s: 20.97 us
    # 17 ranks: 3 nodes, 2 node crossings and 14 NVLink hops
    assert model.ring_fill(17, link) == pytest.approx(2 * (30e-6 + step) + 14 * (4e-6 + step))
    flat = model.Link(beta=25e9, t_chunk=30e-6, delta=20e-6, hops="flat")
    assert model.ring_fill(17, flat) == pytest.approx(16 * (30e-6 + step))
    assert model.hop_latency(17, link) == pytest.approx(2 * 30e-6 + 14 * 4e-6)


def test_every_at_64_gpus_by_hand(model):
    link = model.Link(beta=25e9, t_chunk=30e-6, delta=20e-6)
    r = model.estimate("every", 32, 32, 1, link)
    total = model.model_bytes()
    fill = model.ring_fill(33, link)
    assert r["t_s"] == pytest.approx(total / 25e9 + fill + 32 * 87 * 20e-6)
    per_sender = model.estimate("every", 32, 32, 1, link, wavefront=False)
    assert per_sender["t_s"] - r["t_s"] == pytest.approx(31 * fill)


@pytest.mark.parametrize("trainers,engines,tp", [(8, 8, 1), (32, 32, 1), (256, 768, 1),
                                                 (256, 96, 8)])
def test_one_is_within_the_target_of_one_nics_bound(model, trainers, engines, tp):
    r = model.estimate("one", trainers, engines, tp, model.CENTRAL)
    bound = model.model_bytes() / model.CENTRAL.beta
    assert r["t_s"] <= model.TARGET * bound, r
    # and it is no better than the bound: every byte leaves trainer 0's NIC
    assert r["t_s"] >= bound
