"""model.path -> the policy's Hugging Face directory, on the trainer ranks.

    tiny:<task>         the embedded tiny model's warm start, built on first use by the
                        trainer ranks together (a collective) and cached
    smollm2:<variant>   SmolLM2, fetched and converted once by the leader (trainer 0) and cached;
                        the other ranks wait at the barrier, then read the cache
    <directory>         a local Hugging Face checkpoint, as it is

What needs the trainer's process group or the trainer's code comes in as arguments (the warm
start is built by trainer code, which models/ does not import). The generators read the
trainers' answer from the store (model/path) rather than resolving it again.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def resolve_model_path(spec: str, *, leader: bool, barrier: Callable[[], None],
                       log: Callable[[str], None],
                       build_tiny: Callable[[str], Path]) -> str:
    """The directory of model.path `spec`. `leader`: this rank fetches what is fetched once
    (trainer 0); `barrier`: waits for every trainer rank; `log`: the leader's log line;
    `build_tiny(task)`: the tiny warm start's directory, built if it is not cached yet (called
    on every rank)."""
    if spec.startswith("tiny:"):
        return str(build_tiny(spec.split(":", 1)[1]))
    if spec.startswith("smollm2:"):
        from llamarl.models.smollm2 import ensure_smollm2, model_dir

        variant = spec.split(":", 1)[1]
        if leader:
            path = ensure_smollm2(variant, log=log)
        barrier()
        return str(path if leader else model_dir(variant))
    if not (Path(spec) / "config.json").is_file():
        raise ValueError(f"model.path {spec!r} is not a Hugging Face model directory (no "
                         "config.json): point it at a local checkpoint, or use tiny:reverse "
                         "or smollm2:135m-instruct")
    return spec
