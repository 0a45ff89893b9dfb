"""What third-party code prints in a generator process, kept to lines worth reading.

* vLLM's logger: each distinct warning once. Some of its warnings fire on every call of a
  patched function (the CPU worker replaces torch.set_num_threads with a function that warns
  "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip
  it." each time: four identical lines per SmolLM2 launch); the first says it all.
* `torch.distributed.reduce_op is deprecated` (FutureWarning, with its source line): vLLM's
  kernel dispatcher reads every attribute of the modules it scans, torch.distributed's
  deprecated alias among them, at import. Nothing the user or llamarl calls: ignored.
"""

from __future__ import annotations

import logging
import warnings


class OncePerMessage(logging.Filter):
    """Passes each distinct (logger, level, message) once."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def quiet_third_party() -> None:
    """Call before importing vLLM (the warning filter) and again after (its handlers exist
    then); idempotent."""
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.reduce_op.*deprecated",
                            category=FutureWarning)
    for handler in logging.getLogger("vllm").handlers:
        if not any(isinstance(f, OncePerMessage) for f in handler.filters):
            handler.addFilter(OncePerMessage())
