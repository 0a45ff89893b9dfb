"""The service over two trainer ranks, launched as users launch it (`torchrun --nproc-per-node 2
-m llamarl.service`, gloo on the CPU): rank 0 serves, rank 1 follows (service/ranks.py). The
SDK's losses and logprobs equal a one-process server's on the same calls, over several steps
(which holds only if rank 1's replica of the adapter and of AdamW's state stays rank 0's: its
half of each batch enters every loss); bad requests are refused before rank 1 sees them; a
stopped server ends both ranks."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

tinker = pytest.importorskip("tinker")
from conftest import ROOT, child_env  # noqa: E402
from tinker import types  # noqa: E402

from llamarl.service.server import start  # noqa: E402


def _datum(tokens: list[int], prompt: int) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:],
                                       "weights": [0.0] * (prompt - 1)
                                       + [1.0] * (len(tokens) - prompt)})


DATA = [_datum([5, 6, 7, 8, 9, 10], 2), _datum([11, 12, 13, 14], 2),
        _datum([20, 19, 18, 17, 16], 1), _datum([7, 7, 8, 8, 9, 9, 10], 3),
        _datum([25, 26, 27], 1)]  # (5 data: rank 0 runs 3, rank 1 runs 2)


def _train(url: str, model: str) -> tuple[list[float], list[torch.Tensor]]:
    sc = tinker.ServiceClient(base_url=url, api_key="tml-local")
    tc = sc.create_lora_training_client(base_model=model, rank=4, seed=0).result()
    losses = []
    for _ in range(3):
        fb = tc.forward_backward(DATA, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-3, grad_clip_norm=1.0)).result()
        losses.append(fb.result().metrics["loss:sum"])
    out = tc.forward(DATA, "cross_entropy").result()
    losses.append(out.metrics["loss:sum"])
    with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
        tc.forward_backward([_datum([5, 6, 99999], 1)], "cross_entropy").result()
    return losses, [torch.tensor(o["logprobs"].data) for o in out.loss_fn_outputs]


def test_two_trainer_ranks_train_as_one(tiny_model_dir, tmp_path):
    args = ["recipes/serve_smollm2_cpu.yaml", f"model.path={tiny_model_dir}",
            "service.port=0", "model.dtype=float32", "service.sampling=false"]
    one = start(args[0], [*args[1:], f"service.dir={tmp_path / 'one'}"])
    thread = threading.Thread(target=one.serve, daemon=True)
    thread.start()
    try:
        expected = _train(one.url, str(tiny_model_dir))
    finally:
        one.stop()
        thread.join(60)

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", "-m", "llamarl.service", *args,
           f"service.dir={tmp_path / 'two'}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(OMP_NUM_THREADS=1),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        url = None
        while url is None:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(lines)[-3000:]
            assert time.monotonic() < deadline, "".join(lines)[-3000:]
            lines.append(line)
            if line.startswith("llamarl service: http://"):
                assert "2 trainer ranks" in line, line
                url = line.split()[2]
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
        losses, logprobs = _train(url, str(tiny_model_dir))
        assert losses == pytest.approx(expected[0], rel=1e-5), (losses, expected[0])
        assert losses[-1] < 0.8 * losses[0]
        for got, want in zip(logprobs, expected[1]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    finally:
        proc.send_signal(signal.SIGINT)  # (what Ctrl-C sends: torchrun passes it on)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    out = "".join(lines)
    # both ranks ended cleanly (rank 1 on rank 0's stop, not inside a collective); torchrun
    # itself reports the signal it was stopped by (its own exit status and traceback)
    assert "[rank0]" not in out and "[rank1]" not in out, out[-3000:]
    assert "Connection closed by peer" not in out, out[-3000:]
    del rc
