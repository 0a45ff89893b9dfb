"""After a sync the vLLM engine computes what the trainer's model computes: both after the first
sync (vLLM's load_weights, recorded) and after the second (the recorded copies, replayed)."""

import json
from pathlib import Path

import pytest
from conftest import DIST, torchrun


@pytest.mark.parametrize("tp", [1, 2])
def test_weight_broadcast_parity_with_fsdp2_trainers(tmp_path, tiny_model_dir, tp):
    """tp = 2: one engine of two ranks (generator/tp.py), each loading half of every layer;
    from the second sync on each receives only the half it loads (resharded)."""
    out = tmp_path / "parity.json"
    segments = set(Path("/dev/shm").glob("llamarl_*"))
    proc = torchrun(2 + tp, [str(DIST / "weight_sync_parity.py")], timeout=600, OUT=out,
                    MODEL_DIR=tiny_model_dir, RUNS=tmp_path / "runs", TP=tp)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert set(Path("/dev/shm").glob("llamarl_*")) <= segments, "vLLM's tp segments are left"
    r = json.loads(out.read_text())
    assert r["buckets"] >= 2, "both trainer ranks must send their shards"
    assert r["greedy_match"], r
    assert r["max_abs_dlogprob"] <= 1e-3, r
    assert r["checksum_after"] != r["checksum_before"]
    assert any(r["changed_tokens"]), "the sync must change what the engine generates"
    assert r["replayed"], "the second sync replays the recorded copies"
    if tp == 1:
        assert 0 < r["in_place"] < r["buckets"], "some buckets are received in place, some copied"
        assert r["bytes_resharded"] == r["bytes_full"]
    else:  # the second sync sent this tp rank its half of most tensors (norms whole)
        assert r["in_place"] == 0, "resharded blocks go to the receive buffers first"
        assert 0.5 * r["bytes_full"] <= r["bytes_resharded"] < 0.6 * r["bytes_full"], r
    assert 0 < r["sent_as_is"] < r["buckets"], "some sent from the parameters, some packed"
    assert r["checksum_after_2"] != r["checksum_after"], "the replayed sync changes the weights"
    # the tiny model: 4 query heads + 2 x 2 key/value heads of 32 = 256 rows, split over tp
    assert r["qkv_rows"] == 256 // tp, r
