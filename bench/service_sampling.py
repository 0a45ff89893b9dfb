"""The Tinker service's sampling, side by side: through the SDK against the engine's own
in-process call, for the base and for a LoRA adapter, with the adapter merged into the engine's
weights (service.sampling_lora: merged) and through vLLM's LoRA layers (adapters).

    python bench/service_sampling.py [--modes merged adapters] [--repeats 3]
                                     [--prompts 16] [--samples 8] [--tokens 32]

Workload: SmolLM2-135M-Instruct (recipes/serve_smollm2_cpu.yaml, model.dtype auto), the
first --prompts prompts of recipes/data/add2_train.jsonl in the chat template, --samples
samples of exactly --tokens tokens each (stop disabled: every variant generates the same
number of tokens), temperature 1. The adapter: a rank-32 tenant (attention and MLP, not the
head) after one optim_step, saved for the sampler.

For each mode, one server in this process (the modes take turns: one engine at a time), and
per variant the seconds of each repeat after one untimed warm-up:

  engine_base, engine_lora   the sampler's own call (Sampler.sample) on all requests at once
  api_base, api_lora         the same requests through the SDK: each prompt one `sample`
                             future, all submitted before the first result is read (what
                             examples/tinker_rl_loop.py does)

The summary gives tokens/s (medians) and the ratios the service issue asks about: api / engine
(goal >= 0.9) and, per mode, lora / base.
"""

from __future__ import annotations

import json
import sys
import threading

from harness import ROOT, bench_parser, median, time_calls, write_result

sys.path.insert(0, str(ROOT))


def _requests(tok, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in open(ROOT / "recipes/data/add2_train.jsonl")][:n]
    return [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                    add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for r in rows]


def run_mode(mode: str, args) -> dict:
    import tinker
    from tinker import types

    from llamarl.service.sampler import SampleJob
    from llamarl.service.server import start

    served = start("recipes/serve_smollm2_cpu.yaml",
                   ["service.port=0", f"service.sampling_lora={mode}",
                    f"service.dir={args.dir}/{mode}", "service.max_tenants=1"])
    thread = threading.Thread(target=served.serve, daemon=True)
    thread.start()
    try:
        sc = tinker.ServiceClient(base_url=served.url, api_key="tml-local")
        tc = sc.create_lora_training_client(base_model="smollm2:135m-instruct", rank=32,
                                            seed=0, train_unembed=False).result()
        tok = tc.get_tokenizer()
        prompts = _requests(tok, args.prompts)
        first = prompts[0] + tok.encode(" 42", add_special_tokens=False)
        weights = [0.0] * (len(prompts[0]) - 1) + [1.0] * (len(first) - len(prompts[0]))
        tc.forward_backward([types.Datum(model_input=types.ModelInput.from_ints(first[:-1]),
                                         loss_fn_inputs={"target_tokens": first[1:],
                                                         "weights": weights})],
                            "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        lora = tc.save_weights_and_get_sampling_client().result()
        adapter = served.service.adapter_of(lora._sampling_session_id)
        base = sc.create_sampling_client(base_model="smollm2:135m-instruct").result()
        params = {"max_tokens": args.tokens, "temperature": 1.0, "stop": [], "seed": 0}
        sampler = served.service.sampler

        def engine(adapter_dir):
            return lambda: sampler.sample([SampleJob(p, args.samples, params, adapter_dir,
                                                     False) for p in prompts])

        def api(client):
            sp = types.SamplingParams(max_tokens=args.tokens, temperature=1.0, stop=[],
                                      seed=0)

            def call():
                futures = [client.sample(types.ModelInput.from_ints(p),
                                         num_samples=args.samples, sampling_params=sp)
                           for p in prompts]
                got = [len(s.tokens) for f in futures for s in f.result().sequences]
                assert got == [args.tokens] * len(got), got
            return call

        seconds = {}
        for name, fn in (("engine_base", engine(None)), ("api_base", api(base)),
                         ("engine_lora", engine(adapter)), ("api_lora", api(lora))):
            seconds[name] = time_calls(fn, args.repeats)
            print(f"{mode} {name}: {[round(s, 2) for s in seconds[name]]} s", flush=True)
        return seconds
    finally:
        served.stop()
        thread.join(60)


def main() -> None:
    ap = bench_parser("service_sampling", __doc__, repeats=3)
    ap.add_argument("--modes", nargs="+", default=["merged", "adapters"],
                    choices=["merged", "adapters"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dir", default="/tmp/llamarl-bench-service")
    args = ap.parse_args()
    tokens = args.prompts * args.samples * args.tokens
    runs, summary = {}, {}
    for mode in args.modes:
        runs[mode] = run_mode(mode, args)
        tps = {k: tokens / median(v) for k, v in runs[mode].items()}
        summary[mode] = {
            "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
            "api_over_engine_base": round(tps["api_base"] / tps["engine_base"], 3),
            "api_over_engine_lora": round(tps["api_lora"] / tps["engine_lora"], 3),
            "lora_over_base_engine": round(tps["engine_lora"] / tps["engine_base"], 3)}
    print(json.dumps(summary, indent=1))
    write_result("service_sampling", {"tokens_per_call": tokens, "seconds": runs,
                                      "summary": summary}, args)


if __name__ == "__main__":
    main()
