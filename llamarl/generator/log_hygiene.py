"""What third-party code prints in a llamarl rank (mostly a generator's vLLM), kept to lines
worth reading. Every rank calls quiet_third_party at setup (runtime/setup.py); an engine
started outside a launch (benchmarks, tests) gets it from engine.import_vllm.

* vLLM's logger: each distinct warning once. Some of its warnings fire on every call of a
  patched function (the CPU worker replaces torch.set_num_threads with a function that warns
  "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip
  it." each time, and vLLM's own start-up calls it four times). vLLM re-applies its logging
  configuration (a dictConfig, which replaces its handler) whenever an engine starts, so a
  filter on its handler does not last: llamarl configures vLLM's logger itself instead
  (VLLM_CONFIGURE_LOGGING=0, unless set already), one handler on stderr at
  VLLM_LOGGING_LEVEL (engine.prepare_environment: WARNING) that passes each message once.
* vLLM's warning on the first request that names a LoRA adapter (model.lora.sync adapters),
  "vLLM has deprecated support for supporting different tokenizers for different LoRAs...":
  about a tokenizer in the adapter's directory, which llamarl's in-memory adapter has none
  of (generator/lora_adapter.py): dropped.
* vLLM's tool-call parsers' "Error in extracting tool call from response." with a JSON
  traceback (the gateway's /v1/chat/completions, rollout.tool_parser): a policy writes
  malformed calls while it learns, and the parser then returns the reply as plain content,
  which the agent sees as it would from any OpenAI-style server. An expected event of
  training, not of the run: dropped.
* transformers' "Loading weights" progress bar (every trainer rank, every model it loads: the
  policy, a reference, a critic): a carriage-return bar that interleaves across ranks and
  fills a log file with its redraws, for a load that takes seconds. llamarl's own line says
  what was loaded. Off unless HF_HUB_DISABLE_PROGRESS_BARS is set already (transformers reads
  it at import).
* `torch.distributed.reduce_op is deprecated` (FutureWarning, with its source line): vLLM's
  kernel dispatcher reads every attribute of the modules it scans, torch.distributed's
  deprecated alias among them, at import. Nothing the user or llamarl calls: ignored.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

# Messages of vLLM's that say nothing about a llamarl run (the docstring above), by their start
DROPPED = ("vLLM has deprecated support for supporting different tokenizers for different LoRAs",
           "Error in extracting tool call from response")


class OncePerMessage(logging.Filter):
    """Passes each distinct (logger, level, message) once, and none of DROPPED."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        if key in self.seen or key[2].startswith(DROPPED):
            return False
        self.seen.add(key)
        return True


def quiet_third_party() -> None:
    """Call before importing vLLM or transformers (every rank: runtime/setup.py setup);
    idempotent."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.reduce_op.*deprecated",
                            category=FutureWarning)
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    if os.environ["VLLM_CONFIGURE_LOGGING"] != "0":  # the user's choice: vLLM's own logging
        return
    logger = logging.getLogger("vllm")
    if any(isinstance(f, OncePerMessage) for h in logger.handlers for f in h.filters):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        "(vllm) %(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
        datefmt="%m-%d %H:%M:%S"))
    handler.addFilter(OncePerMessage())
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "WARNING").upper())
    logger.propagate = False
