"""A real vLLM engine (tiny model) sampling a batch that its KV cache cannot hold.

    python tests/dist/engine_sampling.py MODEL_DIR KV_CACHE_GIB

48 prompts of 60 tokens (prompt 1 repeats prompt 0) x 8 samples of up to 60 tokens: 384
sequences, far more than the cache holds at full length, and 23k prompt tokens, far more than
one engine step's token budget (4096 on CPU), so vLLM both chunks prefills and preempts running
sequences. Prints one JSON line: preemptions counted in vLLM's scheduler, what the samples
look like, and whether the logprobs the engine reads off the sampler equal vLLM's own (the
test asserts on them).
"""

import json
import sys
import tempfile
from pathlib import Path


def main(model_dir: str, kv_cache_gib: float) -> None:
    from vllm.v1.core.sched import scheduler

    preempted = []
    original = scheduler.Scheduler._preempt_request

    def counting(self, request, *args, **kwargs):  # count, then preempt as vLLM does
        preempted.append(request.request_id)
        return original(self, request, *args, **kwargs)

    scheduler.Scheduler._preempt_request = counting

    from llamarl.config import GeneratorConfig
    from llamarl.generator.engine import Engine, sampler_seed

    cfg = GeneratorConfig(max_model_len=128, kv_cache_gib=kv_cache_gib, block_size=32,
                          prompts_per_step=48, samples_per_prompt=8)
    engine = Engine(model_dir, cfg, "float32", seed=0, on_cpu=True)
    # what the running engine keeps in the temporary directory (vLLM's FileStore: removed)
    store_files = [p.name for p in Path(tempfile.gettempdir()).glob("vllm_dist_*")]
    prompts = [[1] + [4 + (i * 7 + j * 3) % 26 for j in range(59)] for i in range(48)]
    prompts[1] = list(prompts[0])

    def run(seed):
        groups = engine.generate(prompts, 8, 1.0, 60, seed=seed)
        return [[c.token_ids for c in g] for g in groups], groups

    first, groups = run(sampler_seed(0, "train", 0, 0))
    again, _ = run(sampler_seed(0, "train", 0, 0))
    other, _ = run(sampler_seed(0, "train", 1, 0))

    # the logprobs read off the sampler (the CPU default) against vLLM's own logprobs outputs,
    # on this batch of chunked prefills and preemptions, and on greedy single samples (n = 1)
    def both_ways(*args):
        read = [[(c.token_ids, c.logprobs) for c in g] for g in engine.generate(*args)]
        capture, engine.logprob_capture = engine.logprob_capture, None
        try:
            asked = [[(c.token_ids, c.logprobs) for c in g] for g in engine.generate(*args)]
        finally:
            engine.logprob_capture = capture
        return read == asked and len(read) > 0

    capture_on = engine.logprob_capture is not None
    sampler_read = capture_on and both_ways(prompts, 8, 1.0, 60, sampler_seed(0, "train", 0, 0))
    greedy_read = capture_on and both_ways(prompts[:6], 1, 0.0, 20, sampler_seed(0, "greedy", 0, 0))
    samples = [s for g in first for s in g]
    print(json.dumps({
        "preemptions": len(preempted),
        "kv": engine.kv.describe(),
        "groups": len(first), "sizes": sorted({len(g) for g in first}),
        "lengths_ok": all(1 <= len(s) <= 60 for s in samples),
        "logprobs_ok": all(len(c.logprobs) == len(c.token_ids) for g in groups for c in g),
        "duplicate_prompt_identical": sum(a == b for a, b in zip(first[0], first[1])),
        # sample i of every prompt: with shared draws, equal prompts gave equal samples; here
        # count how often the first token of sample i agrees between prompts 0 and 1 per i
        "first_token_agree": sum(a[0] == b[0] for a, b in zip(first[0], first[1])),
        "distinct_in_group0": len({tuple(s) for s in first[0]}),
        "same_seed_identical": first == again,
        "other_seed_identical": first == other,
        "store_files": store_files,
        "sampler_logprobs_equal_vllm": sampler_read, "greedy_logprobs_equal_vllm": greedy_read,
    }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
