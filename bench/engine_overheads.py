"""What two of the engine's choices save on a generate call, side by side in one process.

Engines of the same recipe start in one process (vLLM in-process, one thread each, as in the
2-engine recipe), and take turns on the same prompts with the same seeds, so the machine's
drift hits all alike:

    default          the engine as llamarl builds it
    vllm_logprobs    the sampled tokens' logprobs asked of vLLM (SamplingParams(logprobs=0))
                     instead of read off its sampler (generator/sampled_logprobs.py)
    prefix_cache_on  vLLM's prefix cache forced on where no sequence can fill a KV block
                     (max_model_len below the block size; the engine turns it off there)

Reports per variant the median seconds per call over --calls (the first 3 skipped), its ratio
to `default`, and whether its samples (token ids and logprobs) equal the default's: they must.
Written to bench/results/engine_overheads.json, with the schema's keys of bench/harness.py.

    python bench/engine_overheads.py [--recipe recipes/tiny_grpo_2engines_cpu.yaml] [--calls 40]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from harness import ROOT, bench_parser, median, write_result

sys.path.insert(0, str(ROOT))
VARIANTS = ("default", "vllm_logprobs", "prefix_cache_on")


def build_engine(variant: str, model_dir: str, cfg):
    import vllm

    from llamarl.generator.engine import Engine

    original = vllm.LLM.__init__

    def prefix_cache_on(self, *args, **kwargs):
        original(self, *args, **{**kwargs, "enable_prefix_caching": True})

    if variant == "prefix_cache_on":
        vllm.LLM.__init__ = prefix_cache_on
    try:
        engine = Engine(model_dir, cfg.generator, cfg.model.dtype, seed=cfg.run.seed,
                        on_cpu=True)
    finally:
        vllm.LLM.__init__ = original
    if variant == "vllm_logprobs":
        engine.logprob_capture = None
    return engine


def main() -> None:
    ap = bench_parser("engine_overheads", __doc__)
    ap.add_argument("--recipe", default="recipes/tiny_grpo_2engines_cpu.yaml")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from llamarl.config import load_config
    from llamarl.data.dataset import load_prompt_data
    from llamarl.data.loader import PromptLoader, shard
    from llamarl.data.prompts import PromptFormatter
    from llamarl.generator.engine import sampler_seed
    from llamarl.models.tiny import warm_start_dir

    cfg = load_config(ROOT / args.recipe, [])
    g = cfg.generator
    spec = cfg.model.path
    model_dir = str(warm_start_dir(spec.split(":", 1)[1]) if spec.startswith("tiny:") else spec)
    if not (Path(model_dir) / "config.json").is_file():
        raise SystemExit(f"no model at {model_dir}: run the recipe once (make run builds and "
                         "caches the tiny model's warm start), or give a recipe whose "
                         "model.path is a local checkpoint")
    variants = ["default"] + [v for v in args.variants if v != "default"]
    engines = {v: build_engine(v, model_dir, cfg) for v in variants}
    fmt = PromptFormatter(engines["default"].tokenizer, cfg.data.chat_template,
                          cfg.data.system_prompt)
    train = fmt.encode(shard(load_prompt_data(cfg.data, cfg.run.seed).train, 0, g.engines))
    loader = PromptLoader(train, cfg.run.seed, 0, g.engines)
    times = {v: [] for v in variants}
    same = {v: True for v in variants}
    for call in range(args.calls):
        prompts = [p.token_ids for p in loader.next(g.prompts_per_step // g.engines)]
        seed = sampler_seed(cfg.run.seed, "train", call, 0)
        samples = {}
        for v in (variants if call % 2 else variants[::-1]):
            t0 = time.perf_counter()
            groups = engines[v].generate(prompts, g.samples_per_prompt, g.temperature,
                                         g.max_new_tokens, seed=seed)
            times[v].append(time.perf_counter() - t0)
            samples[v] = [(c.token_ids, c.logprobs) for grp in groups for c in grp]
        for v in variants:
            same[v] = same[v] and samples[v] == samples["default"]
    base = median(times["default"][3:])
    out = {"recipe": args.recipe, "calls": args.calls,
           "prompts_per_call": g.prompts_per_step // g.engines,
           "samples_per_prompt": g.samples_per_prompt, "threads": os.environ["OMP_NUM_THREADS"]}
    for v in variants:
        med = median(times[v][3:])
        out[v] = {"s_per_call_median": med, "over_default": med / base,
                  "same_samples_as_default": same[v], "s_all": times[v]}
        print(f"{v:16s} {med:.4f} s per call  {med / base:.3f}x default  "
              f"same samples: {same[v]}")
    print(f"wrote {write_result('engine_overheads', out, args)}")


if __name__ == "__main__":
    main()
