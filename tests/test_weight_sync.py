"""After a sync the vLLM engine computes what the trainer's model computes: both after the first
sync (vLLM's load_weights, recorded) and after the second (the recorded copies, replayed)."""

import json
from pathlib import Path

import pytest
from conftest import DIST, torchrun


# (A tp 2 engine's resharded syncs over gloo's own paths: lora-merged-tp2, which sends the
# merged weights as a plain policy's are sent, and the tp launches of test_tp.py and
# test_file_transport.py, whose engines' logprobs are the trainer's.)
@pytest.mark.parametrize("tp,engines,broadcast", [(1, 1, False),
                                                   (1, 2, True), (2, 1, True), (1, 2, "pairs"),
                                                   (2, 1, "lora"), (1, 1, "adapters"),
                                                   (2, 1, "adapters")],
                         ids=["tp1", "nccl-shaped-2x2", "nccl-shaped-tp2", "pairs-2x2",
                              "lora-merged-tp2", "lora-adapters-tp1", "lora-adapters-tp2"])
def test_weight_broadcast_parity_with_fsdp2_trainers(tmp_path, tiny_model_dir, tp, engines,
                                                     broadcast):
    """tp = 2: one engine of two ranks (generator/tp.py), each loading half of every layer;
    from the second sync on each receives only the half it loads (resharded).

    nccl-shaped: the paths NCCL takes, on gloo (LLAMARL_GLOO_BROADCAST=1): every bucket a
    broadcast, each engine receiving sender by sender; 2 trainer ranks to 2 engines, and the
    per-tp-rank broadcast groups of a resharded tp 2 engine (built only for NCCL otherwise).
    pairs: one group per trainer rank and engine (sync.weight_groups), point to point.
    lora: a LoRA policy (model.lora) whose merged weights W + s B A go to a tp 2 engine,
    resharded from the second sync on, as the base model's would.
    adapters: a LoRA policy whose adapters alone go to an engine that runs the base model
    with vLLM's LoRA layers (model.lora.sync adapters), refreshed in memory every sync; tp 2
    ranks each get them whole (vLLM slices them), and a sync of unchanged adapters leaves
    the engine's samples and logprobs exactly as they were."""
    out = tmp_path / "parity.json"
    segments = set(Path("/dev/shm").glob("llamarl_*"))
    lora = "model.lora.rank=4 trainer.lr=3e-2"  # adapters only: a larger step
    env = ({"OVERRIDES": "sync.weight_groups=pairs"} if broadcast == "pairs" else
           {"OVERRIDES": lora} if broadcast == "lora" else
           {"OVERRIDES": lora + " model.lora.sync=adapters"} if broadcast == "adapters" else
           {"LLAMARL_GLOO_BROADCAST": "1"} if broadcast else {})
    proc = torchrun(2 + engines * tp, [str(DIST / "weight_sync_parity.py")], timeout=600,
                    OUT=out, MODEL_DIR=tiny_model_dir, RUNS=tmp_path / "runs", TP=tp,
                    ENGINES=engines, **env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert set(Path("/dev/shm").glob("llamarl_*")) <= segments, "vLLM's tp segments are left"
    for e in range(1, engines):  # every engine holds the trainers' weights
        other = json.loads(Path(f"{out}.e{e}").read_text())
        assert other["greedy_match"] and other["max_abs_dlogprob"] <= 1e-3, other
    r = json.loads(out.read_text())
    # NCCL's shape: sender by sender, and tp 2 resharded over the per-tp-rank groups
    assert r["ordered"] == (broadcast is True), r
    assert r["tp_groups"] == (2 if broadcast is True and tp == 2 else 0), r
    assert r["buckets"] >= 2, "both trainer ranks must send their shards"
    assert r["greedy_match"], r
    assert r["max_abs_dlogprob"] <= 1e-3, r
    assert r["checksum_after"] != r["checksum_before"]
    assert any(r["changed_tokens"]), "the sync must change what the engine generates"
    assert r["checksum_after_2"] != r["checksum_after"], "the second sync changes the weights"
    # the tiny model: 4 query heads + 2 x 2 key/value heads of 32 = 256 rows, split over tp
    assert r["qkv_rows"] == 256 // tp, r
    if broadcast == "adapters":
        assert r["unchanged"], "a sync of unchanged adapters changed the engine's outputs"
        # A [4, in] and B [out, 4] of 7 linears in 2 blocks, float32, to every tp rank whole
        assert r["bytes_full"] == r["bytes_resharded"] == 2 * 4 * 4 * (
            (128 + 128) * 2 + (128 + 64) * 2 + (128 + 256) * 3), r
        assert not r["replayed"] and r["in_place"] == 0, "each sync goes to vLLM's adapter"
        assert r["sent_as_is"] < r["buckets"], r
        return
    assert r["replayed"], "the second sync replays the recorded copies"
    if tp == 1:
        assert 0 < r["in_place"] < r["buckets"], "some buckets are received in place, some copied"
        assert r["bytes_resharded"] == r["bytes_full"]
    else:  # the second sync sent this tp rank its half of most tensors (norms whole)
        assert r["in_place"] == 0, "resharded blocks go to the receive buffers first"
        assert 0.5 * r["bytes_full"] <= r["bytes_resharded"] < 0.6 * r["bytes_full"], r
    if broadcast == "lora":  # merged pieces are made each sync: always packed
        assert r["sent_as_is"] < r["buckets"], r
    else:
        assert 0 < r["sent_as_is"] < r["buckets"], "some sent from the parameters, some packed"


def _parity_run(tmp_path, tiny_model_dir, name, tp, engines, overrides, **env) -> list[dict]:
    out = tmp_path / f"{name}.json"
    proc = torchrun(2 + engines * tp, [str(DIST / "weight_sync_parity.py")], timeout=600,
                    OUT=out, MODEL_DIR=tiny_model_dir, RUNS=tmp_path / f"runs-{name}", TP=tp,
                    ENGINES=engines, OVERRIDES=overrides, **env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(out.read_text())] + [json.loads(Path(f"{out}.e{e}").read_text())
                                            for e in range(1, engines)]


# shared groups to 2 engines; a tp 2 engine on NCCL's paths (broadcasts, the resharding
# group wsync0t<k> from the second sync); pair groups; a LoRA policy's merged weights to a
# tp 2 engine, resharded
@pytest.mark.parametrize("tp,engines,overrides,env", [
    (1, 2, "", {}),
    (2, 1, "", {"LLAMARL_GLOO_BROADCAST": "1"}),
    (1, 2, "sync.weight_groups=pairs", {}),
    (2, 1, "model.lora.rank=4 trainer.lr=3e-2", {})],
    ids=["shared-2x2", "nccl-shaped-tp2", "pairs-2x2", "lora-merged-tp2"])
def test_one_sender_delivers_the_bytes_every_sender_does(tmp_path, tiny_model_dir, tp,
                                                         engines, overrides, env):
    """sync.senders one (trainer 0 sends the gathered full tensors) against every (each
    trainer rank its shards), 2 FSDP2 trainer ranks, the same training: every engine rank
    holds the very same bytes after the first sync (load_weights) and the second (replayed;
    resharded with tp 2), and one sender's engines received from one sender."""
    every = _parity_run(tmp_path, tiny_model_dir, "every", tp, engines,
                        f"{overrides} sync.senders=every", **env)
    one = _parity_run(tmp_path, tiny_model_dir, "one", tp, engines,
                      f"{overrides} sync.senders=one", **env)
    for e, (a, b) in enumerate(zip(every, one)):
        assert b["greedy_match"] and b["max_abs_dlogprob"] <= 1e-3, (e, b)
        assert a["sha_after_1"] == b["sha_after_1"], f"engine {e}: first sync differs"
        assert a["sha_after_2"] == b["sha_after_2"], f"engine {e}: second sync differs"
        assert a["sha_after_1"] != a["sha_after_2"]
    assert one[0]["senders"] == 1 and every[0]["senders"] == 2
    if tp == 2:  # the second sync sent each tp rank its half of most tensors
        assert 0.5 * one[0]["bytes_full"] <= one[0]["bytes_resharded"] < 0.6 * one[0][
            "bytes_full"], one[0]
