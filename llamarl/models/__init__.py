"""Models that llamarl builds or fetches by name (`model.path: smollm2:135m-instruct`), cached
under one directory; the embedded tiny model (llamarl/tiny) is cached there too."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$LLAMARL_CACHE, default ~/.cache/llamarl."""
    return Path(os.environ.get("LLAMARL_CACHE", Path.home() / ".cache" / "llamarl"))
