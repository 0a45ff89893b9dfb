"""Two real vLLM engines (tiny model) where no sequence can fill a KV block: the engine's own
choice (prefix cache off) and vLLM's prefix cache forced on. They must sample the same tokens
with the same logprobs: the cache can never hit there, so turning it off changes nothing but
the time.

    python tests/dist/engine_prefix_cache.py MODEL_DIR

Prints one JSON line for tests/test_sampling.py.
"""

import json
import sys


def main(model_dir: str) -> None:
    import vllm

    from llamarl.config import GeneratorConfig
    from llamarl.generator.engine import Engine, sampler_seed

    # max_model_len 64 under the CPU's default 128-token blocks, as in the tiny recipes
    cfg = GeneratorConfig(max_model_len=64, prompts_per_step=16, samples_per_prompt=8)
    auto = Engine(model_dir, cfg, "float32", seed=0, on_cpu=True)
    original = vllm.LLM.__init__

    def forced_on(self, *args, **kwargs):  # the engine as it was: prefix cache always on
        original(self, *args, **{**kwargs, "enable_prefix_caching": True})

    vllm.LLM.__init__ = forced_on
    try:
        cached = Engine(model_dir, cfg, "float32", seed=0, on_cpu=True)
    finally:
        vllm.LLM.__init__ = original
    prompts = [[1] + [4 + (i * 5 + j * 3) % 26 for j in range(6 + i % 8)] for i in range(16)]
    out = {}
    for name, engine in (("auto", auto), ("cached", cached)):
        runs = [engine.generate(prompts, 8, 1.0, 12, seed=sampler_seed(0, "train", s, 0))
                for s in range(3)]
        out[name] = [[(c.token_ids, c.logprobs) for c in g] for groups in runs for g in groups]
        out[f"{name}_vllm_prefix_caching"] = bool(
            engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)
    print(json.dumps({"auto_prefix_caching": out["auto_vllm_prefix_caching"],
                      "cached_prefix_caching": out["cached_vllm_prefix_caching"],
                      "same_samples": out["auto"] == out["cached"],
                      "tokens": sum(len(t) for g in out["auto"] for t, _ in g)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
