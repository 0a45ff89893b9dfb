"""`python -m llamarl.model_check MODEL_DIR [--adapter PEFT_DIR]`: transformers and vLLM
generate the same greedy tokens from a converted or exported model (models/smollm2.py runs it
once, before caching a conversion). With `--adapter`, from MODEL_DIR with a PEFT LoRA adapter
directory on it (`llamarl.export` writes OUT_DIR/adapter): PEFT's PeftModel in transformers,
vLLM's LoRA layers (`enable_lora`, a LoRARequest naming the directory) in vLLM.

Run in a process of its own: vLLM's in-process engine must not start in a trainer rank
(docs/generator.md: no default process group may span the engine's process). Prompts are
chat-templated; for each, the first `max_tokens` greedy tokens must be equal, except after a
near tie (the two best logits of transformers' float32 forward within `TIE`), where the
sequences may part, and the tokens' logprobs equal within `LOGPROB_TOL` up to there (a
model that generates one token whatever its weights still shows a wrong load there). Exit 0
and one line when they agree, 1 and the first disagreement otherwise.
"""

from __future__ import annotations

import os
import sys

PROMPTS = ["What is 47 + 38? Reply with just the number.",
           "Name the capital of France.",
           "Write one sentence about the sea."]
# for a model without a chat template (the embedded tiny model, which reverses strings)
PLAIN_PROMPTS = ["abcd=", "hello=", "qrstuv="]
TIE = 1e-3  # logit gap below which float32 rounding may pick either token
# largest difference of a greedy token's logprob between the two (float32 both: rounding,
# ~1e-5); a model or adapter that one of them did not load differs by far more
LOGPROB_TOL = 1e-3


def greedy_hf(model, prompt_ids: list[int], n: int,
              ) -> tuple[list[int], list[float], list[float]]:
    """n greedy tokens from transformers, the gap between the two best logits at each, and
    each token's logprob."""
    import torch

    ids = torch.tensor([prompt_ids])
    out, gaps, logprobs = [], [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(ids).logits[0, -1].double()
            top = torch.topk(logits, 2)
            out.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            logprobs.append(float(torch.log_softmax(logits, -1)[top.indices[0]]))
            ids = torch.cat([ids, top.indices[:1].view(1, 1)], dim=1)
    return out, gaps, logprobs


def first_disagreement(hf: list[int], gaps: list[float], vllm: list[int]) -> int | None:
    """The first position where the two sequences differ without a near tie, else None."""
    for i, (a, b) in enumerate(zip(hf, vllm)):
        if a != b:
            return None if gaps[i] < TIE else i
    return None


def check(model_dir: str, max_tokens: int = 12, adapter: str | None = None) -> str | None:
    """None when transformers and vLLM agree on every prompt; else what differs. `adapter`:
    a PEFT LoRA directory run on the model in both."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # Started from a trainer rank under torchrun (models/smollm2.py), this process inherits
    # the rank's launcher variables: vLLM's one-rank world must not read them (nor torchrun's
    # agent store), as in generator/engine.prepare_environment.
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        os.environ.pop(key, None)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams, TokensPrompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = PROMPTS if tok.chat_template else PLAIN_PROMPTS
    if tok.chat_template:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                           add_generation_prompt=True, return_dict=False)
                   for p in texts]
    else:  # (the embedded tiny model's character tokenizer has no chat template)
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        prompts = [bos + tok.encode(p, add_special_tokens=False) for p in texts]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lora, engine_args = None, {}
    if adapter:
        import json
        from pathlib import Path

        from peft import PeftModel
        from vllm.lora.request import LoRARequest

        from llamarl.generator.lora_adapter import engine_lora_args

        model = PeftModel.from_pretrained(model, adapter).eval()
        rank = json.loads((Path(adapter) / "adapter_config.json").read_text())["r"]
        engine_args = engine_lora_args(rank)
        lora = LoRARequest("checked", 1, str(adapter))
    expected = [greedy_hf(model, p, max_tokens) for p in prompts]
    del model
    on_cpu = not torch.cuda.is_available()
    memory = {"kv_cache_memory_bytes": 1 << 28} if on_cpu else {"gpu_memory_utilization": 0.3}
    # (a small model's positions may stop early: the tiny model's at 128)
    length = min(512, getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings",
                              512))
    from llamarl.generator.engine import file_store_removed

    with file_store_removed():  # (vLLM leaves its one-rank FileStore in /tmp otherwise)
        llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=length,
                  max_num_seqs=len(prompts), seed=0, **memory, **engine_args)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                       logprobs=0),
                        use_tqdm=False, lora_request=lora)
    for text, (hf, gaps, hf_lp), out in zip(texts, expected, outs):
        got = list(out.outputs[0].token_ids)
        at = first_disagreement(hf, gaps, got)
        if at is not None:
            return (f"prompt {text!r}: greedy token {at} is {got[at]} in vLLM and {hf[at]} in "
                    f"transformers ({tok.decode(got)!r} vs {tok.decode(hf)!r})")
        got_lp = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, got)]
        for i, (a, b, x, y) in enumerate(zip(hf_lp, got_lp, hf, got)):
            if x != y:  # parted after a near tie: nothing to compare from here
                break
            if abs(a - b) > LOGPROB_TOL:
                return (f"prompt {text!r}: greedy token {i}'s logprob is {b:.6f} in vLLM and "
                        f"{a:.6f} in transformers (more than {LOGPROB_TOL} apart)")
    return None


def main() -> int:
    args = sys.argv[1:]
    if len(args) not in (1, 3) or (len(args) == 3 and args[1] != "--adapter"):
        print("usage: python -m llamarl.model_check MODEL_DIR [--adapter PEFT_DIR]",
              file=sys.stderr)
        return 2
    problem = check(args[0], adapter=args[2] if len(args) == 3 else None)
    if problem:
        print(f"greedy generation disagrees: {problem}", flush=True)
        return 1
    print(f"greedy generation agrees on {len(PROMPTS)} prompts", flush=True)  # (as many plain)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # vLLM's in-process engine leaves non-daemon threads behind
