"""The SDK compatibility table of docs/service.md (llamarl/service/compat.py): generated from
the installed SDK, every method classified, the page current; and the served methods that
tests/test_service_api.py does not drive, driven here through the SDK."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from llamarl.service import compat  # noqa: E402
from llamarl.service.server import start  # noqa: E402


def test_the_page_holds_the_table_of_the_installed_sdk():
    methods = compat.sdk_methods()
    listed = {(c, m) for c, ms in methods.items() for m in ms}
    assert set(compat.SUPPORT) == listed, set(compat.SUPPORT) ^ listed  # (none stale)
    assert all(status in ("yes", "local", "no") for status, _ in compat.SUPPORT.values())
    page = compat.PAGE.read_text()
    assert compat.page_text(page) == page, ("docs/service.md's table is stale: run "
                                            "python -m llamarl.service.compat --write")


def test_an_unclassified_method_is_named(monkeypatch):
    monkeypatch.delitem(compat.SUPPORT, ("TrainingClient", "optim_step"))
    with pytest.raises(ValueError, match="TrainingClient.optim_step: add each to SUPPORT"):
        compat.table()


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:],
                                       "weights": [1.0] * (len(tokens) - 1)})


def test_the_other_served_methods_through_the_sdk(tiny_model_dir, tmp_path):
    served = start("recipes/serve_smollm2_cpu.yaml",
                   [f"model.path={tiny_model_dir}", "service.port=0", "model.dtype=float32",
                    f"service.dir={tmp_path}", "service.sampling=true"])
    thread = threading.Thread(target=served.serve, daemon=True)
    thread.start()
    try:
        sc = tinker.ServiceClient(base_url=served.url, api_key="tml-local")
        rest = tinker.RestClient(base_url=served.url, api_key="tml-local")
        for caps in (sc.get_server_capabilities(), rest.get_server_capabilities().result()):
            assert [m.model_name for m in caps.supported_models] == [str(tiny_model_dir)]
        kw = {"base_model": str(tiny_model_dir), "rank": 4, "train_unembed": False}
        custom, plain = (sc.create_lora_training_client(seed=0, **kw).result()
                         for _ in range(2))
        data = [_datum([5, 6, 7, 8, 9]), _datum([10, 11, 12])]

        # forward_backward_custom with the cross-entropy written by hand = cross_entropy
        def nll(batch, logprobs):
            return -sum((lp * torch.tensor(d.loss_fn_inputs["weights"].data)).sum()
                        for d, lp in zip(batch, logprobs)), {}

        custom.forward_backward_custom(data, nll).result()
        plain.forward_backward(data, "cross_entropy").result()
        for tc in (custom, plain):
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        after = [tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
                 for tc in (custom, plain)]
        assert after[0] == pytest.approx(after[1], rel=1e-5)

        # load_state / load_state_with_optimizer into a live client; weights_info; samplers
        saved = custom.save_state("one").result().path
        plain.load_state(saved).result()
        assert plain.forward(data, "cross_entropy").result().metrics["loss:sum"] == after[0]
        plain.load_state_with_optimizer(saved).result()
        info = rest.get_weights_info_by_tinker_path(saved).result()
        assert (info.is_lora, info.lora_rank) == (True, 4)
        path = custom.save_weights_for_sampler("one").result().path
        sampling = custom.create_sampling_client(path).result()
        assert len(sampling.compute_logprobs(types.ModelInput.from_ints([5, 6, 7])).result()) == 3
        assert rest.get_sampler(sampling._sampling_session_id).result().model_path.endswith(
            "sampler_weights/one")

        # close: the session ends, its training clients are freed, the adapters saved for
        # its sampling clients alone deleted (the named ones stay)
        ephemeral = custom.save_weights_and_get_sampling_client().result()
        unnamed = served.service.adapter_of(ephemeral._sampling_session_id)
        assert unnamed.is_dir() and unnamed.name.startswith("ephemeral-")
        sc.close("success").result()
        deadline = time.monotonic() + 30
        while (info := httpx.post(served.url + "/api/v1/get_info",
                                  json={"model_id": custom.model_id})).status_code == 200:
            assert time.monotonic() < deadline, "close() did not free the training clients"
            time.sleep(0.1)
        assert info.status_code == 404 and "no model" in info.json()["detail"]
        deadline = time.monotonic() + 30
        while unnamed.exists():
            assert time.monotonic() < deadline, "the session's unnamed adapter was kept"
            time.sleep(0.1)
        assert (tmp_path / path[len("tinker://"):].split("/")[0].replace(":", "_")
                / "sampler_weights" / "one" / "meta.json").is_file()
    finally:
        served.stop()
        thread.join(60)
