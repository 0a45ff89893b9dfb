"""`python -m llamarl.models.check MODEL_DIR`: transformers and vLLM generate the same greedy
tokens from a converted model (models/smollm2.py runs it once, before caching a conversion).

Run in a process of its own: vLLM's in-process engine must not start in a trainer rank
(docs/generator.md: no default process group may span the engine's process). Prompts are
chat-templated; for each, the first `max_tokens` greedy tokens must be equal, except after a
near tie (the two best logits of transformers' float32 forward within `TIE`), where the
sequences may part. Exit 0 and one line when they agree, 1 and the first disagreement
otherwise.
"""

from __future__ import annotations

import os
import sys

PROMPTS = ["What is 47 + 38? Reply with just the number.",
           "Name the capital of France.",
           "Write one sentence about the sea."]
TIE = 1e-3  # logit gap below which float32 rounding may pick either token


def greedy_hf(model, prompt_ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens from transformers, and the gap between the two best logits at each."""
    import torch

    ids = torch.tensor([prompt_ids])
    out, gaps = [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(ids).logits[0, -1].double()
            top = torch.topk(logits, 2)
            out.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            ids = torch.cat([ids, top.indices[:1].view(1, 1)], dim=1)
    return out, gaps


def first_disagreement(hf: list[int], gaps: list[float], vllm: list[int]) -> int | None:
    """The first position where the two sequences differ without a near tie, else None."""
    for i, (a, b) in enumerate(zip(hf, vllm)):
        if a != b:
            return None if gaps[i] < TIE else i
    return None


def check(model_dir: str, max_tokens: int = 12) -> str | None:
    """None when transformers and vLLM agree on every prompt; else what differs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                       add_generation_prompt=True, return_dict=False)
               for p in PROMPTS]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = [greedy_hf(model, p, max_tokens) for p in prompts]
    del model
    on_cpu = not torch.cuda.is_available()
    memory = {"kv_cache_memory_bytes": 1 << 28} if on_cpu else {"gpu_memory_utilization": 0.3}
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=512,
              max_num_seqs=len(prompts), seed=0, **memory)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    for text, (hf, gaps), out in zip(PROMPTS, expected, outs):
        got = list(out.outputs[0].token_ids)
        at = first_disagreement(hf, gaps, got)
        if at is not None:
            return (f"prompt {text!r}: greedy token {at} is {got[at]} in vLLM and {hf[at]} in "
                    f"transformers ({tok.decode(got)!r} vs {tok.decode(hf)!r})")
    return None


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python -m llamarl.models.check MODEL_DIR", file=sys.stderr)
        return 2
    problem = check(sys.argv[1])
    if problem:
        print(f"greedy generation disagrees: {problem}", flush=True)
        return 1
    print(f"greedy generation agrees on {len(PROMPTS)} prompts", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # vLLM's in-process engine leaves non-daemon threads behind
