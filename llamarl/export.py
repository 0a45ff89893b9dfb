"""`python -m llamarl.export CHECKPOINT OUT_DIR`: a sharded checkpoint as a Hugging Face
directory (safetensors + config + tokenizer) that transformers and vLLM load. A LoRA run's
checkpoint (model.lora) gives the merged model there (W + s B A) and the adapters as a PEFT
adapter directory in OUT_DIR/adapter (adapter_config.json + adapter_model.safetensors, for
PeftModel.from_pretrained on the base model, or vLLM's LoRARequest).

Runs in one process, with no launcher: the DCP shards of every trainer rank are merged
into full tensors; the config and tokenizer come from the base model recorded in the
checkpoint's meta.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def export(checkpoint: Path, out_dir: Path) -> Path:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoConfig, AutoTokenizer

    from llamarl.tiny.model import save_hf_dir

    meta_path = Path(checkpoint) / "meta.json"
    if not meta_path.is_file():
        raise ValueError(f"{checkpoint} is not a complete llamarl checkpoint (no meta.json)")
    meta = json.loads(meta_path.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        flat = Path(tmp) / "state.pt"
        dcp_to_torch_save(str(checkpoint), str(flat))
        state = torch.load(flat, weights_only=False)["model"]
    adapters = None
    if "lora" in meta:  # the checkpoint holds the adapters; the base is meta's model_path
        from llamarl.trainer.lora import export_lora

        state, adapters = export_lora(meta["lora"], meta["model_path"], state)
    config = AutoConfig.from_pretrained(meta["model_path"])
    if "dtype" in meta:  # the trainer keeps master weights (float32): export the compute dtype
        dtype = getattr(torch, meta["dtype"])
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        config.dtype = dtype
    save_hf_dir(out_dir, state, config, AutoTokenizer.from_pretrained(meta["model_path"]))
    if adapters is not None:  # after save_hf_dir, which writes OUT_DIR anew
        adapters.save_pretrained(str(Path(out_dir) / "adapter"))
    return Path(out_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llamarl.export", description=__doc__)
    ap.add_argument("checkpoint", help="RUN_DIR/checkpoints/step_N")
    ap.add_argument("out_dir")
    args = ap.parse_args(argv)
    try:
        print(f"exported {export(Path(args.checkpoint), Path(args.out_dir))}")
    except ValueError as e:
        print(f"llamarl.export: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
