"""The filesystem weight transport (sync.transport: filesystem, parallel/transports/filesystem.py):
syncs through files between a real sender and two real receivers in one process, a missing
file as a one-line error, the transport seam's errors, and the launcher's runs over files."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import torchrun
from test_async_e2e import SMALL, SOLO, metrics_of
from test_weight_transport import LoadingEngine

from llamarl.parallel.transports import transport_module
from llamarl.parallel.transports.base import TransportSpec
from llamarl.parallel.transports.filesystem import read_mark
from llamarl.parallel.weight_sync import open_weight_sync
from llamarl.tiny.model import build_model


def _spec(tmp_path, me: int, timeout_s: float = 30.0) -> TransportSpec:
    return TransportSpec("filesystem", me, senders=1, receivers=2, directory=str(tmp_path),
                         timeout_s=timeout_s)


def test_syncs_travel_through_files_to_every_receiver_and_are_cleaned_up(tmp_path):
    """Two syncs to two receivers: the first through load_weights (recorded), the second
    replayed from the receive buffers; the files of a bucket go once both receivers read it."""
    model, _ = build_model(0)
    cpu = torch.device("cpu")
    published = []
    sender = open_weight_sync("send", _spec(tmp_path, 0), 64, cpu, 0.015625, model=model,
                              publish_metas=published.append)
    receivers = [open_weight_sync("receive", _spec(tmp_path, j), 64, cpu, 0.015625,
                                  metas=published) for j in (1, 2)]
    assert len(sender.buckets) > 1  # the weight matrices travel alone, the rest packed
    engines = [LoadingEngine(), LoadingEngine()]
    for sync in range(2):
        if sync:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5).add_(0.25)
        sender.publish(model, version=None)  # written at once: no receiver is waiting yet
        sender.wait()
        files = list((tmp_path / "s0").glob("*/b*.safetensors"))
        assert len(files) == len(sender.buckets)
        for receiver, engine in zip(receivers, engines):
            receiver.post()
            receiver.load(engine)
            assert engine.holds(model)
        assert receivers[0].replay is not None, receivers[0].problem
        assert not list((tmp_path / "s0").glob("*/b*")), "read by both: bucket and acks gone"


def test_a_lost_receivers_files_are_swept_and_a_replacement_reads_from_its_first_sync(
        tmp_path):
    """Engines can be lost (the sender has members): receiver 2 dies and never reads, so the
    buckets of syncs 0 and 1 keep waiting for its ack; once the members say every live
    receiver is past them (FileMembers reads the roster and the read marks), the sender's
    next sync removes them whole. A replacement under receiver number 2 starts at the sync
    the trainers chose for it, and its acks complete that sync's buckets again."""
    model, _ = build_model(0)
    cpu = torch.device("cpu")
    published = []

    class Members:
        done = 0  # the first sync a live receiver (or a replacement) may still read

        def begin(self, sync: int) -> int:
            return self.done

    members = Members()
    sender = open_weight_sync("send", _spec(tmp_path, 0), 64, cpu, 0.015625, model=model,
                              publish_metas=published.append,
                              members=lambda transport: members)
    live = open_weight_sync("receive", _spec(tmp_path, 1), 64, cpu, 0.015625, metas=published)
    live_engine = LoadingEngine()  # (later syncs replay the first load into this engine)
    for _ in range(2):  # receiver 2 is gone
        sender.publish(model, version=None)
        sender.wait()
        live.post()
        live.load(live_engine)
    left = sorted(p.parent.name for p in (tmp_path / "s0").glob("*/b*.safetensors"))
    assert set(left) == {"00000000", "00000001"}  # never acked by receiver 2
    assert read_mark(tmp_path, 1) == 0  # (sync 1 is marked when sync 2's receives are posted)
    members.done = 2
    replacement = open_weight_sync(
        "receive", TransportSpec("filesystem", 2, senders=1, receivers=2,
                                 directory=str(tmp_path), timeout_s=30.0,
                                 options={"first_sync": 2}), 64, cpu, 0.015625,
        metas=published)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5).add_(0.25)
    sender.publish(model, version=None)  # sync 2: syncs 0 and 1 are swept
    sender.wait()
    assert sorted(p.name for p in (tmp_path / "s0").iterdir()) == ["00000002"]
    for receiver, engine in ((live, live_engine), (replacement, LoadingEngine())):
        receiver.post()
        receiver.load(engine)
        assert engine.holds(model)
    assert not list((tmp_path / "s0").glob("*/b*")), "read by both: bucket and acks gone"


def test_a_file_that_never_comes_is_a_one_line_error(tmp_path):
    model, _ = build_model(0)
    metas = open_weight_sync("send", _spec(tmp_path, 0), 64, torch.device("cpu"), model=model)
    receiver = open_weight_sync("receive", _spec(tmp_path, 1, timeout_s=0.2), 64,
                                torch.device("cpu"), metas=[metas.metas])
    receiver.post()
    with pytest.raises(RuntimeError, match="did not appear within sync.timeout_s.*"
                                           "sync.transport_dir"):
        receiver.load(LoadingEngine())


def test_a_transport_is_a_registered_name_or_a_module_with_sender_and_receiver():
    assert transport_module("filesystem").Sender.__name__ == "Sender"
    with pytest.raises(ValueError, match="sync.transport 'no_such.module'"):
        transport_module("no_such.module")
    with pytest.raises(ValueError, match="has no Sender and Receiver"):
        transport_module("llamarl.parallel.weight_plan")


@pytest.mark.slow
def test_runs_over_files(tmp_path, cache_dir):
    """The launcher with sync.transport=filesystem: every step samples from the weights the
    trainer sent (the engine's logprobs are the trainer's) to an engine of two ranks; the
    recipe's held-out evaluation runs. This is also the tp recipe's end-to-end run
    (recipes/tiny_grpo_tp2_cpu.yaml: 2 trainer ranks + one engine of tp 2, whose other rank
    follows every call; over the torch transport: tests/test_tp.py). (One engine rank over
    files: the LoRA adapters' run in tests/test_lora.py and the engine-loss runs in
    tests/test_engine_loss.py.)"""
    recipe, ranks = "recipes/tiny_grpo_tp2_cpu.yaml", 4
    shared = tmp_path / "shared"
    tmp = Path(tempfile.gettempdir())
    sockets = {p for p in tmp.iterdir() if p.is_socket()}
    proc = torchrun(ranks, ["-m", "llamarl.launch", recipe, "run.steps=3", SOLO,
                            "sync.transport=filesystem", f"sync.transport_dir={shared}",
                            f"run.output_dir={tmp_path / 'out'}", *SMALL, "run.eval_every=3"],
                    timeout=600, LLAMARL_CACHE=cache_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run, rows = metrics_of(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["mismatch_kl"] < 1e-4 for r in rows), [r["mismatch_kl"] for r in rows]
    assert all(r["staleness_max"] == 0 for r in rows)  # on-policy: the engine waited for each
    assert json.loads((run / "layout.json").read_text())["world_size"] == ranks
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 3]
    assert "[generator 0 (tp rank 1)] followed" in proc.stdout + proc.stderr
    # vLLM's tp message queues' socket files went to the engine's own directory (ipc_dir),
    # which the run's sweep removed; none are left in the temporary directory
    run_id = "-".join(run.name.split("-")[-3:])  # (the run directory: NAME-RUN_ID)
    assert not list(tmp.glob(f"llamarl_{run_id}_*ipc"))
    assert {p for p in tmp.iterdir() if p.is_socket()} <= sockets
    assert not list(shared.rglob("*.safetensors")), "every bucket read and removed"
