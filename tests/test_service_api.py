"""The Tinker service driven by the `tinker` SDK itself, unmodified but for its base URL
(llamarl/service, docs/service.md): training clients, forward_backward + optim_step, state
saved through DCP and restored by a restarted server, the adapter written for vLLM, bad
requests answered with their reason while the other tenant trains on untouched."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from llamarl.service.server import start  # noqa: E402


def _serve(model_path, directory: Path, *extra: str, sampling: bool = False):
    served = start("recipes/serve_smollm2_cpu.yaml",
                   [f"model.path={model_path}", "service.port=0", f"service.dir={directory}",
                    "model.dtype=float32", f"service.sampling={str(sampling).lower()}",
                    *extra])
    thread = threading.Thread(target=served.serve, daemon=True)
    thread.start()
    return served, thread


def _stop(served, thread) -> None:
    served.stop()
    thread.join(30)
    assert not thread.is_alive()


def _sft_datum(tokens: list[int], prompt: int) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:],
                                       "weights": [0.0] * (prompt - 1)
                                       + [1.0] * (len(tokens) - prompt)})


def test_the_sdk_trains_saves_and_a_restarted_server_resumes(tiny_model_dir, tmp_path):
    served, thread = _serve(tiny_model_dir, tmp_path / "svc", "service.max_tenants=2")
    try:
        sc = tinker.ServiceClient(base_url=served.url, api_key="tml-local")
        a = sc.create_lora_training_client(base_model=str(tiny_model_dir), rank=4,
                                           seed=0).result()
        b = sc.create_lora_training_client(base_model=str(tiny_model_dir), rank=4,
                                           seed=1).result()
        assert a.get_info().model_data.tokenizer_id == str(tiny_model_dir)
        assert a.get_tokenizer().encode("ab") == [4, 5]  # offline: the model's directory
        data = [_sft_datum([5, 6, 7, 8, 9, 10], 2), _sft_datum([11, 12, 13, 14], 2)]
        losses = []
        for _ in range(4):
            fb = a.forward_backward(data, "cross_entropy")  # submitted before the step
            step = a.optim_step(types.AdamParams(learning_rate=5e-3))
            losses.append(fb.result().metrics["loss:sum"])
            assert step.result().metrics["step:max"] == len(losses)
        assert losses[-1] < 0.7 * losses[0], losses
        out = a.forward(data, "cross_entropy").result()
        assert [o["logprobs"].shape for o in out.loss_fn_outputs] == [[5], [3]]
        assert -sum(float(torch.tensor(o["logprobs"].data)[1:].sum())
                    for o in out.loss_fn_outputs) == pytest.approx(out.metrics["loss:sum"],
                                                                   rel=1e-5)
        b_before = b.forward(data, "cross_entropy").result().metrics["loss:sum"]

        # bad requests: a 400 naming the problem; the other tenant untouched
        bad = [
            ([types.Datum(model_input=types.ModelInput.from_ints([5, 6, 99999]),
                          loss_fn_inputs={"target_tokens": [6, 7, 8],
                                          "weights": [1.0, 1.0, 1.0]})], "cross_entropy",
             "outside the vocabulary"),
            ([types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                          loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0]})],
             "cross_entropy", "shape"),
            (data, "dpo", "not one this server computes"),
            ([_sft_datum(list(range(4, 4 + 70)) * 40, 2)], "cross_entropy", "over this"),
        ]
        for batch, loss_fn, reason in bad:
            with pytest.raises(tinker.BadRequestError, match=reason):
                a.forward_backward(batch, loss_fn).result()
        with pytest.raises(Exception, match="at most 2 LoRA models"):
            sc.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
        with pytest.raises(tinker.BadRequestError, match="trains"):
            sc.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
        assert b.forward(data, "cross_entropy").result().metrics["loss:sum"] == b_before

        saved = a.save_state("after4").result().path
        assert saved.startswith("tinker://") and saved.endswith("/weights/after4")
        sampler = a.save_weights_for_sampler("s4").result().path
        a_loss = a.forward(data, "cross_entropy").result().metrics["loss:sum"]
        a.forward_backward(data, "cross_entropy").result()
        a.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        next_loss = a.forward(data, "cross_entropy").result().metrics["loss:sum"]
    finally:
        _stop(served, thread)

    # the adapter for vLLM: PEFT's files, adapter tensors only (no base weight)
    adapter = tmp_path / "svc" / saved[len("tinker://"):].split("/")[0].replace(":", "_") \
        / "sampler_weights" / "s4"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    from safetensors.torch import load_file
    tensors = load_file(adapter / "adapter_model.safetensors")
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors)
    assert sampler.endswith("/sampler_weights/s4")

    # a killed server restarts on the same directory: the tenant resumes from its state,
    # Adam's moments included (its next step is the step the first server took)
    served, thread = _serve(tiny_model_dir, tmp_path / "svc")
    try:
        sc = tinker.ServiceClient(base_url=served.url, api_key="tml-local")
        resumed = sc.create_training_client_from_state_with_optimizer(saved).result()
        assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] == a_loss
        resumed.forward_backward(data, "cross_entropy").result()
        resumed.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] == next_loss
        with pytest.raises(tinker.BadRequestError, match="no saved state"):
            sc.create_training_client_from_state("tinker://nobody:train:0/weights/x").result()
        _rest_client_lists(served.url, saved, resumed.model_id)
    finally:
        _stop(served, thread)


def _rest_client_lists(url: str, saved: str, live: str) -> None:
    """The SDK's RestClient on a restarted server: the first server's run (from disk) and the
    live one, their checkpoints, the session; a checkpoint deleted is gone."""
    rest = tinker.RestClient(base_url=url, api_key="tml-local")
    old = saved[len("tinker://"):].split("/")[0]
    assert [c.checkpoint_id for c in rest.list_checkpoints(old).result().checkpoints] == [
        "weights/after4", "sampler_weights/s4"]
    run = rest.get_training_run_by_tinker_path(saved).result()
    assert (run.training_run_id, run.lora_rank, run.is_lora) == (old, 4, True)
    assert run.last_checkpoint.tinker_path == saved
    assert run.last_sampler_checkpoint.checkpoint_id == "sampler_weights/s4"
    runs = rest.list_training_runs().result()
    assert [r.training_run_id for r in runs.training_runs] == [live, old]  # (newest first)
    assert runs.cursor.total_count == 2
    assert rest.get_training_run(live).result().last_checkpoint is None
    every = rest.list_user_checkpoints(limit=1).result()
    assert len(every.checkpoints) == 1 and every.cursor.total_count == 2
    session = live.rsplit(":train:", 1)[0]
    assert rest.get_session(session).result().training_run_ids == [live]
    assert session in rest.list_sessions().result().sessions
    rest.delete_checkpoint_from_tinker_path(saved.replace("/weights/after4",
                                                          "/sampler_weights/s4")).result()
    assert [c.checkpoint_id for c in rest.list_checkpoints(old).result().checkpoints] == [
        "weights/after4"]
    with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
        rest.delete_checkpoint(old, "weights/none").result()
    with pytest.raises(tinker.NotFoundError, match="no training run"):
        rest.get_training_run("nobody:train:0").result()


def test_sft_and_an_rl_step_on_smollm2_through_the_sdk(smollm2_cache, tmp_path, monkeypatch):
    """The recipe's real chat model: its chat-formatted answer's loss falls over 3 steps; then
    one RL step as the cookbook's rl_loop takes it: sample a group from the trained adapter,
    score it, importance_sampling with the sampler's logprobs, optim_step."""
    monkeypatch.setenv("LLAMARL_CACHE", smollm2_cache)
    served, thread = _serve("smollm2:135m-instruct", tmp_path / "svc", "service.max_tenants=8",
                            sampling=True)
    try:
        sc = tinker.ServiceClient(base_url=served.url, api_key="tml-local")
        tc = sc.create_lora_training_client(base_model="smollm2:135m-instruct", rank=8,
                                            seed=0, train_unembed=False).result()
        tok = tc.get_tokenizer()
        prompt = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}],
                                         add_generation_prompt=True, tokenize=False)
        p = tok.encode(prompt)
        full = p + tok.encode("17 + 25 = 42.") + [tok.eos_token_id]
        data = [_sft_datum(full, len(p))]
        losses = []
        for _ in range(3):
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-3))
            losses.append(fb.result().metrics["loss:sum"])
        assert losses[2] < losses[0], losses

        sampler = tc.save_weights_and_get_sampling_client().result()
        group = sampler.sample(types.ModelInput.from_ints(p), num_samples=4,
                               sampling_params=types.SamplingParams(max_tokens=12, seed=3,
                                                                    temperature=1.0)).result()
        assert len(group.sequences) == 4
        rewards = [float("42" in tok.decode(s.tokens)) for s in group.sequences]
        mean = sum(rewards) / len(rewards)
        rl = []
        for s, r in zip(group.sequences, rewards):
            n = len(s.tokens)
            assert len(s.logprobs) == n and all(lp <= 0 for lp in s.logprobs)
            tokens = p + list(s.tokens)
            rl.append(types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:],
                                "logprobs": [0.0] * (len(p) - 1) + list(s.logprobs),
                                "advantages": [0.0] * (len(p) - 1) + [r - mean] * n}))
        out = tc.forward_backward(rl, "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        # the sampler's logprobs are the trained adapter's: the ratio is 1 on every token
        for s, o in zip(group.sequences, out.loss_fn_outputs):
            got = torch.tensor(o["logprobs"].data)[len(p) - 1:]
            assert torch.allclose(got, torch.tensor(s.logprobs), atol=2e-3), (got, s.logprobs)
        _examples_run(served.url)
    finally:
        _stop(served, thread)


def _example(script: str, url: str, *args: str) -> list[dict]:
    """Run examples/<script> against the server; -> its JSON lines."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, f"examples/{script}", "--base-url", url, *args],
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _examples_run(url: str) -> None:
    """The two runnable examples of docs/service.md, a step or two each (their learning
    runs are benchmarks: bench/service_rl.py)."""
    rows = _example("tinker_sl_loop.py", url, "--steps", "2", "--batch", "4", "--eval-every",
                    "1", "--eval-rows", "4", "--save-every", "2")
    assert [r["step"] for r in rows[:2]] == [0, 1] and rows[-1]["answer"], rows
    assert all(math.isfinite(r["train_loss"]) and r["held_out_loss"] > 0 for r in rows[:2])
    resumed = _example("tinker_sl_loop.py", url, "--resume", rows[1]["state"], "--steps", "1",
                       "--batch", "4", "--eval-every", "0", "--save-every", "0")
    assert math.isfinite(resumed[0]["train_loss"]), resumed
    rl = _example("tinker_rl_loop.py", url, "--steps", "1", "--prompts", "2", "--group", "4",
                  "--max-tokens", "8", "--eval-every", "1", "--eval-rows", "4",
                  "--eval-samples", "1")
    assert [r["step"] for r in rl] == [0, 1] and 0 <= rl[0]["reward"] <= 1, rl
    assert all(0 <= r["held_out"] <= 1 for r in rl), rl


@pytest.mark.parametrize("mode", ["merged", "adapters"])
def test_each_sampling_client_samples_its_own_adapter(tiny_model_dir, tmp_path, mode):
    """Two tenants trained on different data; each one's sampling clients (saved by name, or
    made by save_weights_and_get_sampling_client) give the prompt logprobs of that tenant's
    own forward, not the other's or the base's: a request routed to the wrong adapter fails
    this. With vLLM's LoRA layers (adapters) and with the adapter merged into the engine's
    weights (merged: the engine switched between adapters and back to the base)."""
    served, thread = _serve(tiny_model_dir, tmp_path / "svc", f"service.sampling_lora={mode}",
                            sampling=True)
    try:
        sc = tinker.ServiceClient(base_url=served.url, api_key="tml-local")
        with pytest.raises(tinker.BadRequestError, match="train_unembed=False"):
            sc.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
        tenants = [sc.create_lora_training_client(base_model=str(tiny_model_dir), rank=4,
                                                  seed=s, train_unembed=False).result()
                   for s in (0, 1)]
        for tc, seq in zip(tenants, ([5, 6, 7, 8, 9, 10], [20, 19, 18, 17, 16, 15])):
            for _ in range(3):
                tc.forward_backward([_sft_datum(seq, 1)], "cross_entropy")
                tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        probe = [5, 6, 7, 8, 20, 19]
        datum = types.Datum(model_input=types.ModelInput.from_ints(probe[:-1]),
                            loss_fn_inputs={"target_tokens": probe[1:],
                                            "weights": [1.0] * 5})
        own = [torch.tensor(tc.forward([datum], "cross_entropy").result()
                            .loss_fn_outputs[0]["logprobs"].data) for tc in tenants]
        assert not torch.allclose(own[0], own[1], atol=1e-2)
        base = sc.create_sampling_client(base_model=str(tiny_model_dir)).result()
        base_before = base.compute_logprobs(types.ModelInput.from_ints(probe)).result()
        named = [sc.create_sampling_client(
            model_path=tc.save_weights_for_sampler(f"n{i}").result().path).result()
            for i, tc in enumerate(tenants)]
        ephemeral = [tc.save_weights_and_get_sampling_client().result() for tc in tenants]
        for i in (1, 0):  # (the other order too: an engine with both adapters resident)
            for client in (named[i], ephemeral[i]):
                got = torch.tensor(client.compute_logprobs(
                    types.ModelInput.from_ints(probe)).result()[1:])
                assert torch.allclose(got, own[i], atol=1e-4), (i, got, own[i])
        base_after = base.compute_logprobs(types.ModelInput.from_ints(probe)).result()
        assert base_after[1:] == base_before[1:]  # (merged: the base weights restored exactly)
        assert not torch.allclose(torch.tensor(base_after[1:]), own[0], atol=1e-2)
        # a name saved again holds the new weights (not the adapter the engine cached)
        tenants[0].forward_backward([_sft_datum([5, 6, 7, 8, 9, 10], 1)], "cross_entropy")
        tenants[0].optim_step(types.AdamParams(learning_rate=5e-2)).result()
        moved = torch.tensor(tenants[0].forward([datum], "cross_entropy").result()
                             .loss_fn_outputs[0]["logprobs"].data)
        assert not torch.allclose(moved, own[0], atol=1e-3)
        again = sc.create_sampling_client(
            model_path=tenants[0].save_weights_for_sampler("n0").result().path).result()
        got = torch.tensor(again.compute_logprobs(types.ModelInput.from_ints(probe))
                           .result()[1:])
        assert torch.allclose(got, moved, atol=1e-4), (got, moved)
        out = ephemeral[0].sample(types.ModelInput.from_ints([5, 6]), num_samples=3,
                                  sampling_params=types.SamplingParams(max_tokens=4, seed=0)
                                  ).result()
        assert [len(s.tokens) for s in out.sequences] == [4, 4, 4] or any(
            s.stop_reason == "stop" for s in out.sequences)
        with pytest.raises(tinker.BadRequestError, match="no saved sampler weights"):
            sc.create_sampling_client(
                model_path="tinker://x:train:0/sampler_weights/none").result()
        with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
            ephemeral[0].sample(types.ModelInput.from_ints([5, 99999]), num_samples=1,
                                sampling_params=types.SamplingParams(max_tokens=2)).result()
    finally:
        _stop(served, thread)


def test_a_client_that_vanishes_frees_its_slot(tiny_model_dir, tmp_path):
    """A session with no heartbeat for service.session_timeout_s is ended and its training
    clients freed: a server full with one tenant takes a new client after that."""
    import httpx

    served, thread = _serve(tiny_model_dir, tmp_path / "svc", "service.max_tenants=1",
                            "service.session_timeout_s=1.5")
    try:
        api = served.url + "/api/v1"
        session = httpx.post(api + "/create_session", json={
            "tags": [], "user_metadata": None, "sdk_version": "raw"}).json()["session_id"]
        rid = httpx.post(api + "/create_model", json={
            "session_id": session, "model_seq_id": 0, "base_model": str(tiny_model_dir),
            "lora_config": {"rank": 2}}).json()["request_id"]
        done = httpx.post(api + "/retrieve_future", json={"request_id": rid}, timeout=30).json()
        assert done["model_id"] == f"{session}:train:0"
        # (this client now vanishes: no heartbeat)
        deadline = time.monotonic() + 30
        while (gone := httpx.post(api + "/get_info",
                                  json={"model_id": done["model_id"]})).status_code == 200:
            assert time.monotonic() < deadline, "the silent session was never ended"
            time.sleep(0.2)
        assert gone.status_code == 404 and "no model" in gone.json()["detail"]
        beat = httpx.post(api + "/session_heartbeat", json={"session_id": session})
        assert beat.status_code == 410 and "no session" in beat.json()["detail"]  # (the SDK
        # stops heartbeating a session on a 410)
        sc = tinker.ServiceClient(base_url=served.url, api_key="tml-local")
        tc = sc.create_lora_training_client(base_model=str(tiny_model_dir), rank=2).result()
        assert tc.forward([_sft_datum([5, 6, 7], 1)], "cross_entropy").result().metrics
        # finished calls' results are dropped after FUTURE_KEEP_S (none pending is)
        from llamarl.service.api import FUTURE_KEEP_S
        svc = served.service
        held = len(svc.futures)
        assert held >= 3 and svc.prune_futures(time.monotonic()) == 0
        assert svc.prune_futures(time.monotonic() + FUTURE_KEEP_S + 1) == held
        assert not svc.futures and not svc.submitted
        old = httpx.post(api + "/retrieve_future", json={"request_id": rid}, timeout=30)
        assert old.status_code == 404 and "no request" in old.json()["detail"]
        assert tc.forward([_sft_datum([5, 6, 7], 1)], "cross_entropy").result().metrics
    finally:
        _stop(served, thread)


def test_a_sampling_server_restarted_in_one_process_samples(tiny_model_dir, tmp_path):
    """A stopped server shuts its vLLM engine down at once. Left to the garbage collector
    (late: vLLM gc.freeze()s what exists when an engine starts), that engine's shutdown tore
    down vLLM's process-wide parallel groups under the next engine: "pipeline model parallel
    group is not initialized" on every sample (a CI failure). The first engine's finalizer,
    run here by hand once the second is up, is what the collector runs."""
    first, thread = _serve(tiny_model_dir, tmp_path / "a", sampling=True)
    _stop(first, thread)
    collected = first.service.sampler.llm.llm_engine.engine_core._finalizer
    served, thread = _serve(tiny_model_dir, tmp_path / "b", sampling=True)
    try:
        collected()  # (a no-op once the engine was shut down by the server's stop)
        sc = tinker.ServiceClient(base_url=served.url, api_key="tml-local")
        base = sc.create_sampling_client(base_model=str(tiny_model_dir)).result()
        lps = base.compute_logprobs(types.ModelInput.from_ints([5, 6, 7])).result()
        assert len(lps) == 3 and all(math.isfinite(x) for x in lps[1:])
    finally:
        _stop(served, thread)
