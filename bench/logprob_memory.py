"""Peak memory and time of one policy forward + backward with the logprobs of the sampled
tokens computed in chunks (the default: the LM head and the float32 softmax in spans of
positions, recomputed in backward) or from whole [B, T, V] logits and one float32 softmax
(chunk_mib=0, as before), on the CPU, each in a fresh process (peak RSS growth
over the process's size before the step). A 32k-vocabulary Qwen2 (hidden 256, 2 layers) on a
micro-batch of 8 x 1024 tokens: the logits dominate, as in LLM RL.

    python bench/logprob_memory.py [--repeats 3]

Medians over --repeats fresh processes, each run's figures under "runs"; written to
bench/results/logprob_memory.json with the schema's keys of bench/harness.py.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

from harness import bench_parser, median, write_result

VOCAB, B, T = 32_000, 8, 1024


def one(chunk: float) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from llamarl.trainer.policy import TokenBatch, token_logprobs

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T))
    ids = torch.randint(0, VOCAB, (B, T))
    batch = TokenBatch(ids, torch.ones(B, T, dtype=torch.long), ids[:, 1:].clone(),
                       torch.ones(B, T - 1), torch.zeros(B, T - 1))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    t0 = time.perf_counter()
    lp, ent = token_logprobs(model, batch, 1.0, chunk_mib=chunk)
    lp.sum().backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_growth_gib": (peak - before) / 2**20, "seconds": seconds}


def main() -> None:
    ap = bench_parser("logprob_memory", __doc__, repeats=3)
    ap.add_argument("--one", type=float, default=None, metavar="CHUNK_MIB",
                    help="child process: one run at this chunk size, printed as JSON")
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one)))
        return
    from llamarl.trainer.policy import LOGPROB_CHUNK_MIB

    logits_gib = B * (T - 1) * VOCAB * 4 / 2**30
    result = {"vocab": VOCAB, "micro_batch": [B, T], "float32_logits_gib": round(logits_gib, 2),
              "runs": {}}
    for name, chunk in (("one_softmax", 0), ("chunked", LOGPROB_CHUNK_MIB)):
        runs = []
        for _ in range(args.repeats):  # a fresh process each: its own peak RSS
            out = subprocess.run([sys.executable, __file__, "--one", str(chunk)],
                                 capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        result[name] = {k: round(median(r[k] for r in runs), 3) for k in runs[0]}
        result["runs"][name] = runs
    result["peak_ratio"] = round(result["one_softmax"]["peak_growth_gib"]
                                 / result["chunked"]["peak_growth_gib"], 2)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    print(f"wrote {write_result('logprob_memory', result, args)}")


if __name__ == "__main__":
    main()
