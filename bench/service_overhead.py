"""The Tinker service's training overhead and its tenants, side by side in one process:

  inproc   a tenant's forward_backward (importance_sampling) + optim_step called on the
           service's LoraTenants directly: the update itself
  api      the same batch through the SDK (HTTP, protobuf both ways, the futures' long polls):
           goal at most 1.2x inproc
  four     four training clients at once, each a thread submitting the same batch: their
           combined trained tokens/s against a lone tenant's (goal at least 1x), and the
           server process's resident memory with four tenants against one (goal at most 1.3x)

    python bench/service_overhead.py [--repeats 3] [--datums 128] [--completion 32] [--rank 8]

Workload: SmolLM2-135M-Instruct (recipes/serve_smollm2_cpu.yaml, model.dtype auto, sampling
off: the sampler has its own bench, bench/service_sampling.py), the RL example's batch shape:
--datums sequences of an add2 prompt in the chat template + --completion tokens drawn at
random (fixed seed), sampler logprobs -1 and advantages +-1. inproc and api alternate, one
untimed warm-up each; the four clients run --repeats rounds after one warm-up round.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time

from harness import ROOT, bench_parser, median, write_result

sys.path.insert(0, str(ROOT))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def batch(tok, datums: int, completion: int, seed: int = 0):
    """-> (tokens list, loss_fn_inputs list): the RL example's datums."""
    rows = [json.loads(line) for line in open(ROOT / "recipes/data/add2_train.jsonl")]
    rng = random.Random(seed)
    out = []
    for i in range(datums):
        p = tok.apply_chat_template([{"role": "user", "content": rows[i // 8]["prompt"]}],
                                    add_generation_prompt=True, tokenize=True,
                                    return_dict=False)
        tokens = p + [rng.randrange(100, 40000) for _ in range(completion)]
        adv = 1.0 if i % 2 else -1.0
        out.append((tokens[:-1], {
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * (len(p) - 1) + [-1.0] * completion,
            "advantages": [0.0] * (len(p) - 1) + [adv] * completion}))
    return out


def main() -> None:
    ap = bench_parser("service_overhead", __doc__, repeats=3)
    ap.add_argument("--datums", type=int, default=128)
    ap.add_argument("--completion", type=int, default=32)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--dir", default="/tmp/llamarl-bench-service-overhead")
    args = ap.parse_args()

    import tinker
    import torch
    from tinker import types

    from llamarl.service.server import start
    from llamarl.service.tenants import AdamStep, Datum

    served = start("recipes/serve_smollm2_cpu.yaml",
                   ["service.port=0", "service.sampling=false", "service.max_tenants=4",
                    f"service.dir={args.dir}"])
    thread = threading.Thread(target=served.serve, daemon=True)
    thread.start()
    try:
        sc = tinker.ServiceClient(base_url=served.url, api_key="tml-local")

        def client(seed):
            return sc.create_lora_training_client(base_model="smollm2:135m-instruct",
                                                  rank=args.rank, seed=seed,
                                                  train_unembed=False).result()

        tc = client(0)
        raw = batch(tc.get_tokenizer(), args.datums, args.completion)
        tokens = sum(len(t) for t, _ in raw)
        sdk_data = [types.Datum(model_input=types.ModelInput.from_ints(t), loss_fn_inputs=i)
                    for t, i in raw]
        own = [Datum(torch.tensor(t), {"target_tokens": torch.tensor(i["target_tokens"]),
                                       "logprobs": torch.tensor(i["logprobs"]),
                                       "advantages": torch.tensor(i["advantages"])})
               for t, i in raw]
        tenants = served.service.tenants
        name = served.service.tenant_of(tc.model_id)
        adam = types.AdamParams(learning_rate=1e-5)

        def inproc():
            tenants.forward(name, own, "importance_sampling", backward=True)
            tenants.optim_step(name, AdamStep(learning_rate=1e-5))

        def api(c=tc):
            fb = c.forward_backward(sdk_data, "importance_sampling")
            c.optim_step(adam).result()
            fb.result()

        seconds = {"inproc": [], "api": []}
        for i in range(args.repeats + 1):
            for key, fn in (("inproc", inproc), ("api", api)):
                t0 = time.perf_counter()
                fn()
                if i:  # (the first round: warm-up)
                    seconds[key].append(time.perf_counter() - t0)
            print({k: [round(x, 2) for x in v] for k, v in seconds.items()}, flush=True)
        rss_one = rss_mib()

        clients = [tc] + [client(s) for s in (1, 2, 3)]
        rounds = []
        for i in range(args.repeats + 1):
            threads = [threading.Thread(target=api, args=(c,)) for c in clients]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if i:
                rounds.append(time.perf_counter() - t0)
            print({"four": [round(x, 2) for x in rounds]}, flush=True)
        rss_four = rss_mib()
    finally:
        served.stop()
        thread.join(60)
    lone_tps = tokens / median(seconds["api"])
    four_tps = 4 * tokens / median(rounds)
    summary = {"tokens_per_batch": tokens,
               "inproc_s_median": round(median(seconds["inproc"]), 2),
               "api_s_median": round(median(seconds["api"]), 2),
               "api_over_inproc": round(median(seconds["api"]) / median(seconds["inproc"]), 3),
               "lone_tokens_per_s": round(lone_tps, 1),
               "four_tokens_per_s": round(four_tps, 1),
               "four_over_lone_throughput": round(four_tps / lone_tps, 3),
               "rss_mib_one": round(rss_one), "rss_mib_four": round(rss_four),
               "rss_four_over_one": round(rss_four / rss_one, 3)}
    print(json.dumps(summary, indent=1))
    write_result("service_overhead", {"seconds": seconds, "four_round_s": rounds,
                                      "summary": summary}, args)


if __name__ == "__main__":
    main()
