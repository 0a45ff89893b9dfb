"""One policy's held-out reward under the two evaluators of bench/peer_trl.py --workload smollm2.

llamarl's held-out curve comes from its vLLM engine (bfloat16 weights, bfloat16 activations);
TRL's from Hugging Face `generate` under bfloat16 autocast over float32 weights (the matrix
products in bfloat16, the residual stream, norms and softmax in float32). Where the two curves
differ, this says whether the evaluators do: it scores the same policy directory with each, on
the recipe's held-out prompts at its temperature, --samples per prompt under each of --seeds.

    python bench/heldout_crosscheck.py --policy RUN_DIR/policy [--policy ...] \
        [--recipe recipes/smollm2_add_cpu.yaml] [--samples 8] [--seeds 0 1] [--out FILE]

Evaluators (each in a process of its own, one after the other, on all the host's cores):
    vllm       llamarl's Engine in the recipe's model.dtype, as the run's evaluation
    hf_bf16    TRL's evaluation in bench/peer_trl.py (left padding, bf16 autocast)
    hf_fp32    the same without autocast: float32 throughout (not by default: over 12 minutes
               for 2 policies x 2 seeds x 1,024 samples on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
EVALUATORS = ("vllm", "hf_bf16", "hf_fp32")


def held_out(recipe: str):
    from llamarl.config import load_config
    from llamarl.data.dataset import load_prompt_data

    cfg = load_config(ROOT / recipe, [])
    return cfg, load_prompt_data(cfg.data, cfg.run.seed).held_out


def score_vllm(policy: str, recipe: str, samples: int, seeds: list[int]) -> list[float]:
    from llamarl.data.prompts import PromptFormatter
    from llamarl.generator.engine import Engine
    from llamarl.rewards.verifiers import numeric

    cfg, held = held_out(recipe)
    g = cfg.generator
    engine = Engine(policy, g, cfg.model.dtype, seed=0, on_cpu=True,
                    sequences=len(held) * samples, threads=os.cpu_count() or 1)
    fmt = PromptFormatter(engine.tokenizer, cfg.data.chat_template, cfg.data.system_prompt)
    prompts = [p.token_ids for p in fmt.encode(held)]
    out = []
    for seed in seeds:
        groups = engine.generate(prompts, samples, g.temperature, g.max_new_tokens,
                                 seed=7919 + seed)
        r = [numeric(engine.tokenizer.decode(c.token_ids, skip_special_tokens=True),
                     ex.answer, ex.prompt) for ex, grp in zip(held, groups) for c in grp]
        out.append(sum(r) / len(r))
    return out


def score_hf(policy: str, recipe: str, samples: int, seeds: list[int],
             autocast: bool) -> list[float]:
    """bench/peer_trl.py's Clock.evaluate, for --samples and each seed."""
    import torch
    from peer_trl import left_padded, trl_eval_seed  # (bench/: the script's own directory)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llamarl.data.prompts import PromptFormatter
    from llamarl.rewards.verifiers import numeric

    torch.set_num_threads(os.cpu_count() or 1)
    cfg, held = held_out(recipe)
    tok = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    fmt = PromptFormatter(tok, cfg.data.chat_template, cfg.data.system_prompt)
    inp, mask = left_padded(fmt.encode(held), tok.pad_token_id)
    width = inp.shape[1]
    out = []
    for seed in seeds:
        torch.manual_seed(trl_eval_seed(0, seed))  # seed s: TRL's seed-0 stream of step s
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            gen = model.generate(input_ids=inp, attention_mask=mask, do_sample=True,
                                 temperature=cfg.generator.temperature, top_p=1.0, top_k=0,
                                 max_new_tokens=cfg.generator.max_new_tokens,
                                 num_return_sequences=samples, pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(gen[:, width:], skip_special_tokens=True)
        r = [numeric(t, held[i // samples].answer, held[i // samples].prompt)
             for i, t in enumerate(texts)]
        out.append(sum(r) / len(r))
    return out


def one(args) -> None:
    """--one EVALUATOR: score every --policy with it, print one JSON line."""
    res = {}
    for policy in args.policy:
        t0 = time.perf_counter()
        if args.one == "vllm":
            r = score_vllm(policy, args.recipe, args.samples, args.seeds)
        else:
            r = score_hf(policy, args.recipe, args.samples, args.seeds,
                         autocast=args.one == "hf_bf16")
        res[policy] = {"per_seed": r, "mean": statistics.mean(r),
                       "seconds": time.perf_counter() - t0}
    print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", action="append", required=True,
                    help="a Hugging Face directory (a run's RUN_DIR/policy; repeatable)")
    ap.add_argument("--recipe", default="recipes/smollm2_add_cpu.yaml")
    ap.add_argument("--samples", type=int, default=8, help="samples per held-out prompt")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--evaluators", nargs="+", default=["vllm", "hf_bf16"], choices=EVALUATORS)
    ap.add_argument("--out", default=str(ROOT / "bench/results/heldout_crosscheck.json"))
    ap.add_argument("--one", choices=EVALUATORS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(args)
    results = {}
    for ev in args.evaluators:  # (each as soon as it is done: a later one may run long)
        cmd = [sys.executable, __file__, "--one", ev, "--recipe", args.recipe,
               "--samples", str(args.samples), "--seeds", *map(str, args.seeds)]
        for p in args.policy:
            cmd += ["--policy", p]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            sys.exit(f"evaluator {ev} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        results[ev] = json.loads(line[0][len("RESULT "):])
        for p, r in results[ev].items():
            print(f"{ev:8s} {p}: {r['mean']:.3f} (seeds {[round(x, 3) for x in r['per_seed']]}"
                  f", {r['seconds']:.0f} s)", flush=True)
        out = {"recipe": args.recipe, "samples_per_prompt": args.samples, "seeds": args.seeds,
               "results": results,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
