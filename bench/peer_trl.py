"""llamarl against a single-process trainer (TRL's GRPOTrainer, plain Hugging Face generate) on
the same model, prompts, reward and hyper-parameters, one run after the other on this machine.

    python bench/peer_trl.py                       # both workloads, 3 seeds of the tiny one
    python bench/peer_trl.py --workload tiny --seeds 0 1 2 3
    python bench/peer_trl.py --workload gen        # the generation-heavy one only
    python bench/peer_trl.py --merge A.json B.json --out AB.json   # seeds of two runs as one
    python bench/peer_trl.py --workload trl_dtype  # TRL's tiny step, float32 against bf16

Workload `tiny` (learning speed): the default recipe (recipes/tiny_grpo_cpu.yaml: the warm-started
tiny Qwen2, string reversal, 64 prompts x 8 samples, lr 1e-3 with 2 warm-up steps, AdamW, grad clip
1, token-mean loss, PPO clip 0.2 against the behaviour policy, no KL) for --steps steps, held-out
reward (128 prompts never trained on x 4 samples at T = 1) every --eval-every steps, for:
  * llamarl on-policy (the default recipe as `make run` runs it),
  * the recipe recommended on a small CPU machine (--recommended; default
    recipes/tiny_grpo_2engines_cpu.yaml: the same run with 1 trainer rank + 2 engines; "" for
    none),
  * TRL GRPOTrainer with the same settings (loss_type dapo = token mean over the batch,
    scale_rewards group, beta 0, epsilon 0.2, one optimizer step per 64 x 8 batch), in
    float32: its faster precision on this workload (`--workload trl_dtype` measures its step
    in float32 and in bf16 autocast, taking turns), where the recommended recipe computes in
    bfloat16 over float32 masters.
Per run: median step time, training time (step times summed, evaluations excluded; with them
in brackets) and steps to held-out reward 0.6 and 0.7. Medians over seeds, and the ratios;
and the same read off the seeds' mean held-out curve (steadier: a seed's own crossing moves by
10-40 steps between seeds). `--merge A.json B.json` makes one table of invocations run on
other seeds.

Workload `gen` (generation-heavy): a 24M-parameter Qwen2 built in code (hidden 512, 8 layers,
8 heads, 2 KV heads, intermediate 1536) with a 512-symbol vocabulary (a random policy then
rarely samples EOS, so responses run to 64-128 tokens), 16 prompts x 8 samples of up to 128
tokens per step. Reports generated tokens/s, trained tokens/s and step time for the default
recipe, the recommended one and TRL, all in float32, or with --gen-dtype bfloat16 all in
bfloat16 mixed precision (llamarl's model.dtype over float32 master weights; TRL's bf16
autocast over float32 weights).

TRL is a bench dependency only (`make bench` installs it), never a runtime one. Results go to
--out (JSON) and are printed as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch_logs import torchrun_logs_in_temp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT = "recipes/tiny_grpo_cpu.yaml"
THRESHOLDS = (0.6, 0.7)


# ---------------------------------------------------------------------------------- llamarl
def run_llamarl(recipe: str, out: Path, overrides: list[str], env: dict) -> Path:
    """One run through the real launcher; returns its run directory."""
    from llamarl.config import load_config

    cfg = load_config(ROOT / recipe, overrides)
    n = cfg.trainer.ranks + cfg.generator.engines * cfg.generator.tp
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           "-m", "llamarl.launch", recipe, f"run.output_dir={out}", *overrides]
    with open(out / "launch.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=log, env=env)
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return run


def llamarl_summary(run: Path) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    step_s = {r["step"]: r["step_time_s"] for r in rows}
    eval_s = {e["step"]: e["eval_s"] for e in evals}
    curve = [(e["step"], e["reward_mean"]) for e in evals]
    # The engine evaluates right after loading the weights of step s, before it samples batch
    # s + 1: on-policy that time sits in the trainer's wait for batch s + 1.
    def train_time(upto: int, with_evals: bool) -> float:
        t = sum(v for k, v in step_s.items() if k <= upto)
        return t if with_evals else t - sum(v for k, v in eval_s.items() if 0 < k < upto)
    return summary(curve, train_time, list(step_s.values()),
                   gen_tok_s=statistics.median(r["tokens_generated"] / r["generate_s"]
                                               for r in rows if r.get("generate_s")))


# -------------------------------------------------------------------------------------- TRL
def run_trl(model_dir: str, seed: int, steps: int, eval_every: int, prompts: int, samples: int,
            max_new_tokens: int, lr: float, warmup: int, out: Path, data_cfg=None,
            bf16: bool = False) -> dict:
    """TRL's GRPOTrainer in this process (HF generate), evaluated like llamarl's Evaluator.
    bf16: TRL's mixed precision (float32 weights and AdamW, the forwards under bfloat16
    autocast: generation's too), as llamarl's model.dtype=bfloat16 over float32 masters."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from llamarl.config import DataConfig
    from llamarl.data.dataset import load_prompt_data
    from llamarl.data.prompts import PromptFormatter
    from llamarl.tiny.task import reverse_reward

    torch.set_num_threads(os.cpu_count() or 1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    data = load_prompt_data(data_cfg or DataConfig(), seed)
    fmt = PromptFormatter(tok)
    bos = tok.bos_token
    train = Dataset.from_list([{"prompt": bos + ex.prompt, "answer": ex.answer}
                               for ex in data.train])
    # TRL tokenises the text; it must give exactly llamarl's prompt ids (BOS + characters)
    ex = data.train[0]
    assert tok(bos + ex.prompt)["input_ids"] == fmt.encode([ex])[0].token_ids
    held = data.held_out

    def reward(completions, answer, **_):
        return [reverse_reward(c, a) for c, a in zip(completions, answer)]

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen_time = [0.0, 0]  # seconds in model.generate, tokens generated

    generate = model.generate

    def timed_generate(*args, **kwargs):
        t0 = time.perf_counter()
        res = generate(*args, **kwargs)
        gen_time[0] += time.perf_counter() - t0
        seqs = res if torch.is_tensor(res) else res.sequences
        prompt_len = (kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[1]
        new = seqs[:, prompt_len:]
        gen_time[1] += int(((new != tok.pad_token_id) & (new != -100)).sum())
        return res

    model.generate = timed_generate
    micro = min(64, prompts * samples)
    config = GRPOConfig(
        output_dir=str(out), seed=seed, max_steps=steps, learning_rate=lr,
        lr_scheduler_type="constant_with_warmup", warmup_steps=warmup, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=prompts * samples // micro,
        num_generations=samples, max_completion_length=max_new_tokens, temperature=1.0,
        top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        num_iterations=1, use_cpu=True, bf16=bf16, fp16=False, logging_steps=1,
        report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)

    class Clock(TrainerCallback):
        """Step times (evaluations excluded) and the held-out curve."""

        def __init__(self):
            self.last, self.step_s, self.eval_s, self.curve = None, [], {}, []
            self.gen = []

        def on_train_begin(self, args, state, control, **kw):
            self.evaluate(0)
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.step_s.append(time.perf_counter() - self.last)
            self.gen.append(tuple(gen_time))
            if eval_every and (state.global_step % eval_every == 0 or state.global_step == steps):
                self.evaluate(state.global_step)
            self.last = time.perf_counter()

        @torch.no_grad()
        def evaluate(self, step):
            t0 = time.perf_counter()
            was = model.training
            model.eval()
            ids = fmt.encode(held)
            width = max(len(p.token_ids) for p in ids)
            inp = torch.tensor([[tok.pad_token_id] * (width - len(p.token_ids)) + p.token_ids
                                for p in ids])
            mask = (torch.arange(width)[None] >= width - torch.tensor(
                [len(p.token_ids) for p in ids])[:, None]).long()
            torch.manual_seed(7919 + step)
            out = generate(input_ids=inp, attention_mask=mask, do_sample=True, temperature=1.0,
                           top_p=1.0, top_k=0, max_new_tokens=max_new_tokens,
                           num_return_sequences=4, pad_token_id=tok.pad_token_id)
            texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
            r = [reverse_reward(t, held[i // 4].answer) for i, t in enumerate(texts)]
            self.curve.append((step, sum(r) / len(r)))
            self.eval_s[step] = time.perf_counter() - t0
            model.train(was)

    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=train,
                          processing_class=tok, callbacks=[clock])
    trainer.train()

    def train_time(upto: int, with_evals: bool) -> float:
        t = sum(clock.step_s[:upto])
        return t + sum(v for k, v in clock.eval_s.items() if 0 < k < upto) if with_evals else t
    gens = [b[0] - a[0] for a, b in zip([(0.0, 0)] + clock.gen, clock.gen)]
    toks = [b[1] - a[1] for a, b in zip([(0.0, 0)] + clock.gen, clock.gen)]
    return summary(clock.curve, train_time, clock.step_s,
                   gen_tok_s=statistics.median(t / g for t, g in zip(toks, gens) if g))


# ---------------------------------------------------------------------------------- shared
def summary(curve, train_time, step_s, **extra) -> dict:
    """Steps and training time to each threshold (first eval at or above it), the curve."""
    out = {"median_step_s": statistics.median(step_s[1:] or step_s), "steps": len(step_s),
           "curve": curve, "final": curve[-1][1], **extra,
           # training time (evaluations excluded) up to each evaluation: for the mean curve
           "train_time_at": [[s, round(train_time(s, False), 2)] for s, _ in curve]}
    for th in THRESHOLDS:
        hit = next((s for s, r in curve if r >= th), None)
        out[f"steps_to_{th}"] = hit
        out[f"time_to_{th}"] = None if hit is None else round(train_time(hit, False), 2)
        out[f"time_to_{th}_with_evals"] = None if hit is None else round(train_time(hit, True), 2)
    return out


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def llamarl_recipes(args) -> list[tuple[str, str]]:
    """(name, recipe) of the llamarl runs of a workload: the default, then --recommended."""
    return [("llamarl", DEFAULT)] + ([("recommended", args.recommended)]
                                     if args.recommended else [])


def run_trl_tiny(seed: int, steps: int, eval_every: int, out: Path, bf16: bool = False) -> dict:
    """run_trl on the tiny workload: the warm-started model and the default recipe's batch,
    response length, lr and warm-up."""
    from llamarl.config import load_config
    from llamarl.tiny.warmstart import warm_start_dir

    cfg = load_config(ROOT / DEFAULT, [])
    g = cfg.generator
    return run_trl(str(warm_start_dir("reverse")), seed, steps, eval_every, g.prompts_per_step,
                   g.samples_per_prompt, g.max_new_tokens, cfg.trainer.lr,
                   cfg.trainer.warmup_steps, out, bf16=bf16)


def tiny_workload(args, env) -> dict:
    results = {"llamarl": [], "recommended": [], "trl": []}
    common = [f"run.steps={args.steps}", f"run.eval_every={args.eval_every}"]
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            for name, recipe in llamarl_recipes(args):
                t0 = time.time()
                run = run_llamarl(recipe, tmp / name, [*common, f"run.seed={seed}"], env)
                results[name].append(llamarl_summary(run))
                print(f"seed {seed} {name}: {time.time() - t0:.0f} s wall, "
                      f"{json.dumps({k: v for k, v in results[name][-1].items() if k != 'curve'})}",
                      flush=True)
            t0 = time.time()
            results["trl"].append(run_trl_tiny(seed, args.steps, args.eval_every, tmp / "trl"))
            print(f"seed {seed} trl: {time.time() - t0:.0f} s wall, "
                  f"{json.dumps({k: v for k, v in results['trl'][-1].items() if k != 'curve'})}",
                  flush=True)
    return {"runs": results, "median": median_table(results)}


def trl_dtype_workload(args) -> dict:
    """TRL's step on the tiny workload in float32 and in bf16 autocast, --trl-dtype-repeats
    runs of --trl-dtype-steps steps each (no evaluations between steps; run_trl's one before
    the first is off the step clock), the two taking turns: the median step of each and their
    ratio, to pick TRL's faster precision for the comparison."""
    steps: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    for _ in range(args.trl_dtype_repeats):
        for name in steps:
            with tempfile.TemporaryDirectory() as tmp:
                r = run_trl_tiny(0, args.trl_dtype_steps, 0, Path(tmp) / "trl",
                                 bf16=name == "bfloat16")
            steps[name].append(r["median_step_s"])
            print(f"trl {name}: median step {r['median_step_s']:.3f} s", flush=True)
    out = {name: {"median_step_s": statistics.median(v), "runs": v} for name, v in steps.items()}
    out["bfloat16_over_float32"] = (out["bfloat16"]["median_step_s"]
                                    / out["float32"]["median_step_s"])
    print(f"TRL's tiny step, bf16 autocast / float32: {out['bfloat16_over_float32']:.2f}x")
    return out


def median_table(results: dict[str, list]) -> dict:
    """Per run name: the medians over seeds of every figure (a key older results lack is
    left out of its median) and the seeds' mean curve."""
    return {name: {**{k: med([r.get(k) for r in runs]) for k in runs[0]
                      if k not in ("curve", "train_time_at")}, **mean_curve(runs)}
            for name, runs in results.items() if runs}


def mean_curve(runs: list[dict]) -> dict:
    """The seeds' held-out rewards averaged at each evaluation: the first evaluation where
    that mean reaches each threshold, and the median over seeds of the training time up to
    it. A less noisy reading than the per-seed crossings (one evaluation apart, 10-40 steps
    between seeds and between runs of the same seed), which the table's medians keep."""
    steps = [s for s, _ in runs[0]["curve"]]
    mean = [statistics.mean(dict(r["curve"])[s] for r in runs) for s in steps]
    out = {"mean_curve": [[s, round(m, 4)] for s, m in zip(steps, mean)]}
    for th in THRESHOLDS:
        hit = next((s for s, m in zip(steps, mean) if m >= th), None)
        out[f"mean_curve_steps_to_{th}"] = hit
        out[f"mean_curve_time_to_{th}"] = None if hit is None else med(
            [dict(r["train_time_at"])[hit] if "train_time_at" in r
             else hit * r["median_step_s"] for r in runs])  # (results of older benches)
    return out


def merge(paths: list[str]) -> dict:
    """The tiny workload of several invocations (other seeds) as one: runs concatenated,
    medians and the mean curve recomputed. Runs written before `train_time_at` existed
    count the time to a mean-curve crossing as steps x their median step."""
    results: dict[str, list] = {}
    for p in paths:
        for name, runs in json.loads(Path(p).read_text())["tiny"]["runs"].items():
            results.setdefault(name, []).extend(runs)
    return {"runs": results, "median": median_table(results), "merged": paths}


def build_gen_model(path: Path) -> str:
    """The 24M Qwen2 with a 512-symbol character vocabulary (random init, saved once)."""
    if (path / "config.json").is_file():
        return str(path)
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from llamarl.tiny.model import SPECIAL, build_tokenizer, save_hf_dir
    from llamarl.tiny.task import ALPHABET, SEPARATOR

    base = list(ALPHABET) + [SEPARATOR, " "] + [str(d) for d in range(10)] + list("+-*")
    extra = [chr(0x400 + i) for i in range(512 - len(SPECIAL) - len(base))]  # Cyrillic block
    tok = build_tokenizer(base + extra)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=512, intermediate_size=1536,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, torch_dtype="float32")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    save_hf_dir(path, model.state_dict(), config, tok)
    return str(path)


def gen_workload(args, env) -> dict:
    model = build_gen_model(Path(tempfile.gettempdir()) / "llamarl-bench-gen24m")
    prompts, samples, new = 16, 8, 128
    overrides = [f"model.path={model}", f"run.steps={args.gen_steps}", "run.eval_every=0",
                 "data.eval_prompts=8", f"generator.prompts_per_step={prompts}",
                 f"generator.max_new_tokens={new}", "generator.max_model_len=160",
                 "trainer.micro_batch_size=32", "trainer.lr=1e-5",
                 f"model.dtype={args.gen_dtype}"]
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, recipe in llamarl_recipes(args):
            run = run_llamarl(recipe, Path(tmp) / name, overrides, env)
            rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][1:]
            result[name] = {
                "median_step_s": med([r["step_time_s"] for r in rows]),
                "gen_tok_s": med([r["tokens_generated"] / r["generate_s"] for r in rows]),
                "train_tok_s": med([r["tokens_generated"] / r["train_s"] for r in rows]),
                "tokens_per_step": med([r["tokens_generated"] for r in rows])}
            print(f"gen {name}: {json.dumps(result[name])}", flush=True)
        from llamarl.config import DataConfig
        trl = run_trl(model, 0, args.gen_steps, 0, prompts, samples, new, 1e-5, 0,
                      Path(tmp) / "trl", DataConfig(eval_prompts=8),
                      bf16=args.gen_dtype == "bfloat16")
        trl.pop("curve", None)
        print(f"gen trl: {json.dumps(trl)}", flush=True)
    return {**result, "trl": trl, "model": "Qwen2 24M, vocab 512", "dtype": args.gen_dtype,
            "batch": f"{prompts} prompts x {samples} samples, up to {new} new tokens"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=("tiny", "gen", "both", "trl_dtype"),
                    default="both")
    ap.add_argument("--trl-dtype-steps", type=int, default=25)
    ap.add_argument("--trl-dtype-repeats", type=int, default=3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--gen-steps", type=int, default=3)
    ap.add_argument("--gen-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the gen workload's compute precision, for both trainers (bfloat16: "
                         "llamarl's model.dtype over float32 masters, TRL's bf16 autocast)")
    ap.add_argument("--recommended", default="recipes/tiny_grpo_2engines_cpu.yaml",
                    help="another llamarl recipe to run beside the default: the one "
                         "recommended on a small CPU machine (\"\" for none)")
    ap.add_argument("--out", default=None, help="the results' JSON (default "
                    "bench/results/peer_trl.json; peer_trl_dtype.json for trl_dtype)")
    ap.add_argument("--merge", nargs="+", metavar="RESULTS", help="no runs: the tiny workload "
                    "of these result files (other seeds) as one table, written to --out")
    args = ap.parse_args()
    if args.out is None:
        name = "peer_trl_dtype" if args.workload == "trl_dtype" else "peer_trl"
        args.out = str(ROOT / f"bench/results/{name}.json")
    if args.merge:  # the seeds of the merged runs, not this command line's default
        args.seeds = [seed for p in args.merge
                      for seed in json.loads(Path(p).read_text())["args"]["seeds"]]
    torchrun_logs_in_temp()  # (bench/launch_logs.py: in `env` below)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = {"machine": f"{os.cpu_count()} cores", "args": vars(args)}
    if args.workload == "trl_dtype":
        result["trl_dtype"] = trl_dtype_workload(args)
    if args.merge:
        result["tiny"] = merge(args.merge)
        args.workload = "tiny"
    elif args.workload in ("tiny", "both"):
        result["tiny"] = tiny_workload(args, env)
    if args.workload in ("tiny", "both"):
        t = result["tiny"]["median"]
        print("\n| run | median step s | steps to 0.6 | train s to 0.6 (with evals) | steps to 0.7 "
              "| train s to 0.7 | final | gen tok/s |\n|---|---|---|---|---|---|---|---|")
        for name, r in t.items():
            print(f"| {name} | {fmt(r['median_step_s'], 3)} | {fmt(r['steps_to_0.6'])} | "
                  f"{fmt(r['time_to_0.6'], 1)} ({fmt(r['time_to_0.6_with_evals'], 1)}) | "
                  f"{fmt(r['steps_to_0.7'])} | {fmt(r['time_to_0.7'], 1)} | "
                  f"{fmt(r['final'], 3)} | {fmt(r['gen_tok_s'], 0)} |")
        if "trl" in t:
            for name in ("llamarl", "recommended"):
                for th in THRESHOLDS:
                    a, b = t.get(name, {}).get(f"time_to_{th}"), t["trl"][f"time_to_{th}"]
                    if a and b:
                        print(f"{name} / TRL training time to {th}: {a / b:.2f}x")
                    a = t.get(name, {}).get(f"mean_curve_time_to_{th}")
                    b = t["trl"][f"mean_curve_time_to_{th}"]
                    if a and b:
                        print(f"{name} / TRL training time to {th}, seeds' mean curve "
                              f"(steps {t[name][f'mean_curve_steps_to_{th}']} / "
                              f"{t['trl'][f'mean_curve_steps_to_{th}']}): {a / b:.2f}x")
    if args.workload in ("gen", "both"):
        result["gen"] = gen_workload(args, env)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
