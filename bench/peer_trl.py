"""llamarl against a single-process trainer (TRL's GRPOTrainer, plain Hugging Face generate) on
the same model, prompts, reward and hyper-parameters, one run after the other on this machine.

    python bench/peer_trl.py                       # both workloads, 3 seeds of the tiny one
    python bench/peer_trl.py --workload tiny --seeds 0 1 2 3
    python bench/peer_trl.py --workload gen        # the generation-heavy one only
    python bench/peer_trl.py --merge A.json B.json --out AB.json   # seeds of two runs as one
    python bench/peer_trl.py --workload trl_dtype  # TRL's tiny step, float32 against bf16
    python bench/peer_trl.py --workload smollm2 --seeds 0 --out A.json   # the real model
    python bench/peer_trl.py --workload smollm2 --merge A.json B.json --out AB.json
    python bench/peer_trl.py --workload smollm2 --trainers llamarl --seeds 0 1 2 --out N.json
    python bench/peer_trl.py --workload smollm2 --merge N.json A.json:trl B.json:trl --out NAB.json

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

Workload `smollm2` (a real chat model): recipes/smollm2_add_cpu.yaml (SmolLM2-135M-Instruct,
chat-templated 2-digit additions, the `numeric` verifier, 16 prompts x 8 samples of up to 32
tokens, lr 5e-6, 1 trainer + 1 engine in bfloat16 over float32 masters) for --steps steps (default
the recipe's 30), held-out reward (the recipe's 128 prompts x 2 samples at T = 1) every
--eval-every steps (default 5), against TRL's GRPOTrainer on the same prompt ids (asserted),
reward and settings in bf16 autocast (its faster precision here: fp32 took about twice as
long). Per run: the median step and its split (llamarl: waiting for the engine / update; TRL:
HF generate / the rest), training time to held-out 0.5 and 0.7, and the peak RSS summed over
the run's processes (sampled every 0.5 s: llamarl's trainer rank, engine and launcher; TRL's
one process). A seed takes about 65 minutes on 2 cores (TRL's 30 steps of ~87 s: 49 of
them), so seeds can be run one invocation each and joined with --merge.

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
SMOLLM2 = "recipes/smollm2_add_cpu.yaml"
THRESHOLDS = {"tiny": (0.6, 0.7), "smollm2": (0.5, 0.7)}


class PeakRSS:
    """The peak, over samples every `period` s, of the resident memory summed over a process
    and its descendants (MiB): a multi-process run's footprint, which no single process's
    ru_maxrss gives."""

    def __init__(self, pid: int | None = None, period: float = 0.5):
        import threading

        import psutil

        self._root = psutil.Process(pid)
        self.peak_mib, self._period = 0.0, period
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        import psutil

        while not self._done.is_set():
            total = 0
            try:
                for p in [self._root, *self._root.children(recursive=True)]:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:  # (a child that ended meanwhile)
                        pass
            except psutil.Error:  # the root ended
                return
            self.peak_mib = max(self.peak_mib, total / 2**20)
            self._done.wait(self._period)

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        return self.peak_mib


def trl_eval_seed(seed: int, step: int) -> int:
    """The torch seed of TRL's held-out evaluation at `step` of the run seeded `seed`.

    Each seed draws a stream of its own, as llamarl's engine does (sampler_seed hashes the run
    seed in), so the seeds' mean averages the evaluations' sampling error too. Until
    2026-12-02 it was 7919 + step for every seed: TRL's seeds shared one stream per step, and
    their evaluations one error (one policy read 0.578 on step 20's stream against 0.554 over
    31 streams, docs/measured/smollm2_vs_trl.md). Seed 0 keeps the old streams."""
    return 7919 + 1000 * seed + step


# ---------------------------------------------------------------------------------- llamarl
def run_llamarl(recipe: str, out: Path, overrides: list[str], env: dict,
                rss: dict | None = None) -> Path:
    """One run through the real launcher; returns its run directory. rss: gets "peak_rss_mib",
    the peak over the run of every process's RSS summed (PeakRSS)."""
    from llamarl.config import load_config

    cfg = load_config(ROOT / recipe, overrides)
    n = cfg.trainer.ranks + cfg.generator.engines * cfg.generator.tp
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           "-m", "llamarl.launch", recipe, f"run.output_dir={out}", *overrides]
    with open(out / "launch.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log, env=env)
        peak = PeakRSS(proc.pid)
        returncode, peak_mib = proc.wait(), peak.stop()
    if returncode:
        raise subprocess.CalledProcessError(returncode, cmd)
    if rss is not None:
        rss["peak_rss_mib"] = peak_mib
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return run


def llamarl_summary(run: Path, thresholds=THRESHOLDS["tiny"]) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    step_s = {r["step"]: r["step_time_s"] for r in rows}
    eval_s = {e["step"]: e["eval_s"] for e in evals}
    curve = [(e["step"], e["reward_mean"]) for e in evals]
    # The engine evaluates right after loading the weights of step s, before it samples batch
    # s + 1: on-policy that time sits in the trainer's wait for batch s + 1, step 0's in step
    # 1's. Step 0's evaluation is never training time (TRL's runs before its clock starts);
    # the later ones count only `with_evals`, as TRL's do.
    def train_time(upto: int, with_evals: bool) -> float:
        t = sum(v for k, v in step_s.items() if k <= upto)
        return t - sum(v for k, v in eval_s.items()
                       if k < upto and (k == 0 or not with_evals))
    later = rows[1:] or rows  # (step 1 also pays the first compilations and allocations)
    return summary(curve, train_time, list(step_s.values()), thresholds,
                   gen_tok_s=statistics.median(r["tokens_generated"] / r["generate_s"]
                                               for r in rows if r.get("generate_s")),
                   median_wait_s=statistics.median(r["wait_s"] for r in later),
                   median_update_s=statistics.median(r["train_s"] for r in later),
                   trainer_peak_rss_mib=max(r["peak_rss_mib"] for r in rows),
                   greedy_curve=[(e["step"], e.get("reward_mean_greedy")) for e in evals])


# -------------------------------------------------------------------------------------- TRL
def left_padded(prompts, pad_id: int):
    """HF generate's batch of prompts (llamarl Prompt objects): ids [B, W] padded on the left,
    attention mask [B, W]."""
    import torch

    width = max(len(p.token_ids) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p.token_ids)) + p.token_ids for p in prompts])
    mask = (torch.arange(width)[None] >= width - torch.tensor(
        [len(p.token_ids) for p in prompts])[:, None]).long()
    return ids, mask


def run_trl(model_dir: str, seed: int, steps: int, eval_every: int, prompts: int, samples: int,
            max_new_tokens: int, lr: float, warmup: int, out: Path, data_cfg=None,
            bf16: bool = False, reward_fn=None, eval_samples: int = 4,
            thresholds=THRESHOLDS["tiny"]) -> dict:
    """TRL's GRPOTrainer in this process (HF generate), evaluated like llamarl's Evaluator
    (eval_samples per held-out prompt at T = 1). The prompts are the text llamarl's
    PromptFormatter makes of data_cfg's rows (chat template and system prompt included), and
    TRL's tokenisation of it must give llamarl's prompt ids exactly. reward_fn(completion,
    answer, prompt) -> float (default: the tiny task's reversal reward).
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
    data_cfg = data_cfg or DataConfig()
    data = load_prompt_data(data_cfg, seed)
    fmt = PromptFormatter(tok, data_cfg.chat_template, data_cfg.system_prompt)
    # llamarl's text (BOS + characters without a chat template); TRL tokenises it, with the
    # tokenizer's own special tokens, and must give exactly llamarl's prompt ids
    bos = "" if data_cfg.chat_template else tok.bos_token
    train = Dataset.from_list([{"prompt": bos + fmt.text(ex.prompt), "answer": ex.answer}
                               for ex in data.train])
    for ex in data.train[:8]:
        assert tok(bos + fmt.text(ex.prompt))["input_ids"] == fmt.encode([ex])[0].token_ids
    held = data.held_out
    score = reward_fn or (lambda completion, answer, prompt: reverse_reward(completion, answer))

    def reward(completions, answer, prompts, **_):
        return [score(c, a, p) for c, a, p in zip(completions, answer, prompts)]

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
            inp, mask = left_padded(fmt.encode(held), tok.pad_token_id)
            width = inp.shape[1]
            torch.manual_seed(trl_eval_seed(seed, step))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = generate(input_ids=inp, attention_mask=mask, do_sample=True,
                               temperature=1.0, top_p=1.0, top_k=0,
                               max_new_tokens=max_new_tokens, num_return_sequences=eval_samples,
                               pad_token_id=tok.pad_token_id)
            texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
            r = [score(t, held[i // eval_samples].answer, held[i // eval_samples].prompt)
                 for i, t in enumerate(texts)]
            self.curve.append((step, sum(r) / len(r)))
            self.eval_s[step] = time.perf_counter() - t0
            model.train(was)

    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=train,
                          processing_class=tok, callbacks=[clock])
    rss = PeakRSS()
    trainer.train()
    peak_rss_mib = rss.stop()

    def train_time(upto: int, with_evals: bool) -> float:
        t = sum(clock.step_s[:upto])
        return t + sum(v for k, v in clock.eval_s.items() if 0 < k < upto) if with_evals else t
    gens = [b[0] - a[0] for a, b in zip([(0.0, 0)] + clock.gen, clock.gen)]
    toks = [b[1] - a[1] for a, b in zip([(0.0, 0)] + clock.gen, clock.gen)]
    later = slice(1, None) if len(gens) > 1 else slice(None)
    return summary(clock.curve, train_time, clock.step_s, thresholds,
                   gen_tok_s=statistics.median(t / g for t, g in zip(toks, gens) if g),
                   median_generate_s=statistics.median(gens[later]),
                   median_rest_s=statistics.median(
                       s - g for s, g in zip(clock.step_s[later], gens[later])),
                   peak_rss_mib=peak_rss_mib)


# ---------------------------------------------------------------------------------- shared
def summary(curve, train_time, step_s, thresholds, **extra) -> dict:
    """Steps and training time to each threshold (first eval at or above it), the curve."""
    out = {"median_step_s": statistics.median(step_s[1:] or step_s), "steps": len(step_s),
           "curve": curve, "final": curve[-1][1], **extra,
           # training time (evaluations excluded) up to each evaluation: for the mean curve
           "train_time_at": [[s, round(train_time(s, False), 2)] for s, _ in curve]}
    for th in thresholds:
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
    from llamarl.models.tiny import warm_start_dir

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


def median_table(results: dict[str, list], thresholds=THRESHOLDS["tiny"]) -> dict:
    """Per run name: the medians over seeds of every figure (a key older results lack is
    left out of its median) and the seeds' mean curve."""
    return {name: {**{k: med([r.get(k) for r in runs]) for k in runs[0]
                      if k not in ("curve", "train_time_at", "greedy_curve")},
                   **mean_curve(runs, thresholds)}
            for name, runs in results.items() if runs}


def mean_curve(runs: list[dict], thresholds=THRESHOLDS["tiny"]) -> dict:
    """The seeds' held-out rewards averaged at each evaluation: the first evaluation where
    that mean reaches each threshold, and the median over seeds of the training time up to
    it. A less noisy reading than the per-seed crossings (one evaluation apart, 10-40 steps
    between seeds and between runs of the same seed), which the table's medians keep."""
    steps = [s for s, _ in runs[0]["curve"]]
    mean = [statistics.mean(dict(r["curve"])[s] for r in runs) for s in steps]
    out = {"mean_curve": [[s, round(m, 4)] for s, m in zip(steps, mean)]}
    for th in thresholds:
        hit = next((s for s, m in zip(steps, mean) if m >= th), None)
        out[f"mean_curve_steps_to_{th}"] = hit
        out[f"mean_curve_time_to_{th}"] = None if hit is None else med(
            [dict(r["train_time_at"])[hit] if "train_time_at" in r
             else hit * r["median_step_s"] for r in runs])  # (results of older benches)
    return out


def merge(paths: list[str], workload: str = "tiny") -> dict:
    """A workload (tiny or smollm2) of several invocations (other seeds) as one: runs
    concatenated, medians and the mean curve recomputed. Runs written before `train_time_at`
    existed count the time to a mean-curve crossing as steps x their median step."""
    results: dict[str, list] = {}
    for p in paths:
        p, _, only = p.partition(":")  # FILE:NAME takes that trainer's runs only
        for name, runs in json.loads(Path(p).read_text())[workload]["runs"].items():
            if only in ("", name):
                results.setdefault(name, []).extend(runs)
    return {"runs": results, "median": median_table(results, THRESHOLDS[workload]),
            "merged": paths}


def smollm2_workload(args, env) -> dict:
    """recipes/smollm2_add_cpu.yaml against TRL on the same prompts, reward and settings, one
    after the other per seed. TRL in bf16 autocast where the recipe's model.dtype (auto)
    resolves to bfloat16, in float32 where it resolves to float32 (an AVX2-only CPU, whose
    bfloat16 products are 7-300x slower: llamarl/models/precision.py)."""
    from llamarl.config import load_config
    from llamarl.models.smollm2 import ensure_smollm2
    from llamarl.rewards.verifiers import numeric

    steps = args.steps or None
    common = [f"run.eval_every={args.eval_every}"] + ([f"run.steps={steps}"] if steps else [])
    cfg = load_config(ROOT / SMOLLM2, common)
    g, th = cfg.generator, THRESHOLDS["smollm2"]
    model = str(ensure_smollm2(cfg.model.path.split(":", 1)[1]))
    results = {name: [] for name in args.trainers}
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            if "llamarl" in results:
                t0, rss = time.time(), {}
                run = run_llamarl(SMOLLM2, Path(tmp) / "llamarl", [*common, f"run.seed={seed}"],
                                  env, rss)
                results["llamarl"].append({**llamarl_summary(run, th), **rss, "seed": seed})
                print(f"seed {seed} llamarl: {time.time() - t0:.0f} s wall, "
                      f"{brief(results['llamarl'])}", flush=True)
            if "trl" not in results:
                continue
            t0 = time.time()
            trl = run_trl(model, seed, cfg.run.steps, cfg.run.eval_every, g.prompts_per_step,
                          g.samples_per_prompt, g.max_new_tokens, cfg.trainer.lr,
                          cfg.trainer.warmup_steps, Path(tmp) / "trl", cfg.data,
                          bf16=cfg.model.dtype == "bfloat16",
                          reward_fn=numeric, eval_samples=cfg.data.eval_samples_per_prompt,
                          thresholds=th)
            results["trl"].append({**trl, "seed": seed})
            print(f"seed {seed} trl: {time.time() - t0:.0f} s wall, {brief(results['trl'])}",
                  flush=True)
    return {"runs": results, "median": median_table(results, th), "recipe": SMOLLM2}


def plot_smollm2(result: dict, path: Path) -> bool:
    """Held-out reward against training time (evaluations excluded), llamarl and TRL: each
    seed a thin line, the seeds' mean curve (at the median time to each evaluation) thick.
    False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=120)
    for (name, runs), color in zip(result["runs"].items(), ("tab:blue", "tab:orange")):
        for r in runs:
            at = dict(r["train_time_at"])
            ax.plot([at[s] / 60 for s, _ in r["curve"]], [v for _, v in r["curve"]],
                    color=color, alpha=0.3, lw=1)
        steps = [s for s, _ in result["median"][name]["mean_curve"]]
        times = [statistics.median(dict(r["train_time_at"])[s] for r in runs) / 60
                 for s in steps]
        ax.plot(times, [m for _, m in result["median"][name]["mean_curve"]], color=color, lw=2.5,
                marker="o", ms=3, label=f"{'TRL GRPOTrainer' if name == 'trl' else name} "
                f"({len(runs)} seed{'s' if len(runs) > 1 else ''})")
    ax.set_xlabel("training time, minutes (2 CPU cores; evaluations excluded)")
    ax.set_ylabel("held-out reward (T = 1)")
    ax.set_title("SmolLM2-135M-Instruct, 2-digit additions (recipes/smollm2_add_cpu.yaml)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def brief(runs: list[dict]) -> str:
    """The last run's figures without its curves, for the progress lines."""
    return json.dumps({k: v for k, v in runs[-1].items() if "curve" not in k})


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


def print_table(workload: str, t: dict) -> None:
    """The medians over seeds as a markdown table, and llamarl's times over TRL's."""
    lo, hi = THRESHOLDS[workload]
    print(f"\n| run | median step s | steps to {lo} | train s to {lo} (with evals) | steps to {hi} "
          f"| train s to {hi} | final | gen tok/s | peak RSS MiB |\n" + "|---" * 9 + "|")
    for name, r in t.items():
        print(f"| {name} | {fmt(r['median_step_s'], 3)} | {fmt(r[f'steps_to_{lo}'])} | "
              f"{fmt(r[f'time_to_{lo}'], 1)} ({fmt(r[f'time_to_{lo}_with_evals'], 1)}) | "
              f"{fmt(r[f'steps_to_{hi}'])} | {fmt(r[f'time_to_{hi}'], 1)} | "
              f"{fmt(r['final'], 3)} | {fmt(r['gen_tok_s'], 0)} | "
              f"{fmt(r.get('peak_rss_mib'), 0)} |")
    if "trl" not in t:
        return
    for name in ("llamarl", "recommended"):
        if name not in t:
            continue
        ratio = t[name]["median_step_s"] / t["trl"]["median_step_s"]
        print(f"{name} / TRL median step: {ratio:.2f}x")
        for th in (lo, hi):
            a, b = t[name].get(f"time_to_{th}"), t["trl"][f"time_to_{th}"]
            if a and b:
                print(f"{name} / TRL training time to {th}: {a / b:.2f}x")
            a = t[name].get(f"mean_curve_time_to_{th}")
            b = t["trl"][f"mean_curve_time_to_{th}"]
            if a and b:
                print(f"{name} / TRL training time to {th}, seeds' mean curve "
                      f"(steps {t[name][f'mean_curve_steps_to_{th}']} / "
                      f"{t['trl'][f'mean_curve_steps_to_{th}']}): {a / b:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=("tiny", "gen", "both", "trl_dtype", "smollm2"),
                    default="both")
    ap.add_argument("--trl-dtype-steps", type=int, default=25)
    ap.add_argument("--trl-dtype-repeats", type=int, default=3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per run (default: 150 for tiny, the recipe's for smollm2)")
    ap.add_argument("--eval-every", type=int, default=None,
                    help="steps between held-out evaluations (default: 10 for tiny, 5 for "
                         "smollm2)")
    ap.add_argument("--gen-steps", type=int, default=3)
    ap.add_argument("--gen-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the gen workload's compute precision, for both trainers (bfloat16: "
                         "llamarl's model.dtype over float32 masters, TRL's bf16 autocast)")
    ap.add_argument("--recommended", default="recipes/tiny_grpo_2engines_cpu.yaml",
                    help="another llamarl recipe to run beside the default: the one "
                         "recommended on a small CPU machine (\"\" for none)")
    ap.add_argument("--out", default=None, help="the results' JSON (default "
                    "bench/results/peer_trl.json; peer_trl_dtype.json for trl_dtype, "
                    "peer_trl_smollm2.json for smollm2)")
    ap.add_argument("--merge", nargs="+", metavar="RESULTS", help="no runs: the tiny (or with "
                    "--workload smollm2, smollm2) workload of these result files (other seeds) "
                    "as one table, written to --out; FILE:NAME takes only trainer NAME's runs "
                    "of FILE (llamarl rerun after a change, against stored TRL runs)")
    ap.add_argument("--trainers", nargs="+", choices=("llamarl", "trl"),
                    default=["llamarl", "trl"],
                    help="smollm2: the trainers to run (llamarl alone after a change of "
                         "llamarl's; TRL's runs do not change with it)")
    args = ap.parse_args()
    smollm2 = args.workload == "smollm2"
    if args.steps is None and not smollm2:
        args.steps = 150
    if args.eval_every is None:
        args.eval_every = 5 if smollm2 else 10
    if args.out is None:
        name = {"trl_dtype": "peer_trl_dtype", "smollm2": "peer_trl_smollm2"}.get(
            args.workload, "peer_trl")
        args.out = str(ROOT / f"bench/results/{name}.json")
    if args.merge:  # the seeds of the merged runs, not this command line's default
        args.seeds = sorted({seed for p in args.merge for seed in json.loads(
            Path(p.partition(":")[0]).read_text())["args"]["seeds"]})
    args.out = str(Path(args.out).resolve())
    # absolute paths (the cwd changes below), each FILE:NAME suffix kept
    args.merge = [str(Path(path).resolve()) + sep + name
                  for path, sep, name in (p.partition(":") for p in args.merge or [])]
    os.chdir(ROOT)  # (the recipes name their data relative to the repository root)
    torchrun_logs_in_temp()  # (bench/launch_logs.py: in `env` below)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = {"machine": f"{os.cpu_count()} cores", "args": vars(args)}
    if args.workload == "trl_dtype":
        result["trl_dtype"] = trl_dtype_workload(args)
    if smollm2:
        result["smollm2"] = (merge(args.merge, "smollm2") if args.merge
                             else smollm2_workload(args, env))
        print_table("smollm2", result["smollm2"]["median"])
        png = Path(args.out).with_suffix(".png")
        if plot_smollm2(result["smollm2"], png):
            print(f"learning curves: {png}")
    elif args.merge:
        result["tiny"] = merge(args.merge)
        args.workload = "tiny"
    elif args.workload in ("tiny", "both"):
        result["tiny"] = tiny_workload(args, env)
    if args.workload in ("tiny", "both"):
        print_table("tiny", result["tiny"]["median"])
    if args.workload in ("gen", "both"):
        result["gen"] = gen_workload(args, env)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
