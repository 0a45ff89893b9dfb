"""Trainer throughput of one RL update: GRPO (policy only) vs PPO (policy + critic + frozen
reference with a KL reward penalty), side by side in one run, FSDP2 on every rank of the launch.

Per algorithm: one warm-up update (its time reported apart: warmup_update_s), then --repeats
timed updates on the same synthetic rollout batch (random token ids: throughput does not depend
on their values). Reports the median seconds per update, trained tokens/s (prompt + completion
tokens of the batch / time), the share of the forwards' tokens that are padding, and the peak
memory (accelerator; on the CPU the growth of the process's peak RSS over the updates), and
PPO's cost relative to GRPO.

--compare: the GRPO update before and after packing and the chunked LM head, side by side, each
in a fresh torchrun (so each peak is its own): `padded` = trainer.micro_batch_size rows padded
to their longest and whole [B, T, V] logits (LOGPROB_CHUNK_MIB = 0); `packed` =
trainer.max_tokens_per_micro_batch = --budget and the default chunked head. --mixed draws
long-tailed completion lengths (log-uniform in [4, --completion-len]) and prompt lengths in
[prompt-len / 2, prompt-len], as RL batches have.

    python bench/trainer_throughput.py --compare --model 32k --mixed   # make bench (CPU)
    torchrun --standalone --nproc-per-node 1 bench/trainer_throughput.py --model tiny
    torchrun --standalone --nproc-per-node 2 bench/trainer_throughput.py --model 24m \
        --seqs 512 --prompt-len 8 --completion-len 40     # the KV-preemption issue's update
    torchrun --standalone --nproc-per-node 8 bench/trainer_throughput.py --model 0.5b \
        --seqs 256 --prompt-len 256 --completion-len 768 --micro-batch 8 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

# Randomly initialised architectures (the tiny one is llamarl.tiny.model's).
SIZES = {
    "24m": dict(hidden_size=512, intermediate_size=1536,  # the tiny tokenizer's vocabulary
                num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                max_position_embeddings=256),
    # a realistic vocabulary (Llama 2's size) on a small body: the LM head dominates, as in RL
    "32k": dict(vocab_size=32000, hidden_size=256, intermediate_size=768,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=2048),
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                 num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 max_position_embeddings=4096),
}


def build_model_dir(kind: str) -> str:
    """A randomly initialised HF directory: the tiny model, the 24M Qwen2 of the KV-preemption
    issue (hidden 512, 8 layers, 2 KV heads, the tiny character tokenizer), or Qwen2.5-0.5B's
    architecture; or SmolLM2-135M-Instruct itself (`smollm2`, the real model's recipes)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from llamarl.tiny.model import build_model, build_tokenizer, save_hf_dir

    if kind == "smollm2":  # the real checkpoint (fetched and converted once, then cached)
        from llamarl.models.smollm2 import ensure_smollm2
        return str(ensure_smollm2("135m-instruct"))
    path = Path(tempfile.gettempdir()) / f"llamarl-bench-trainer-{kind}"
    if (path / "config.json").exists():
        return str(path)
    if kind == "tiny":
        model, tok = build_model(0)
    else:
        tok = build_tokenizer()
        cfg = Qwen2Config(**{"vocab_size": len(tok), **SIZES[kind]}, tie_word_embeddings=True,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
    save_hf_dir(path, model.state_dict(), model.config, tok)
    return str(path)


def synthetic_batch(args, vocab: int, rank: int):
    from llamarl.buffer.record import RolloutBatch

    g = torch.Generator().manual_seed(rank)
    n = args.seqs // dist.get_world_size()

    def length(low: int, high: int, log: bool) -> int:
        u = float(torch.rand(1, generator=g))
        if log:
            return int(math.exp(math.log(low) + u * (math.log(high) - math.log(low))))
        return int(low + u * (high - low))

    plens, clens = [args.prompt_len] * n, [args.completion_len] * n
    if args.mixed:  # one prompt per group of 8, long-tailed completions
        plens = [length(args.prompt_len // 2, args.prompt_len, False) for _ in range(n // 8)
                 for _ in range(8)]
        clens = [length(4, args.completion_len, True) for _ in range(n)]
    prompts = [torch.randint(3, vocab, (p,), generator=g).tolist() for p in plens]
    if args.mixed or args.groups:  # a group's samples answer one prompt (trainer.share_prompts)
        prompts = [prompts[i - i % 8] for i in range(n)]
    comps = [torch.randint(3, vocab, (c,), generator=g).tolist() for c in clens]
    lps = [(-torch.rand(c, generator=g)).tolist() for c in clens]
    rewards = torch.rand(n, generator=g).tolist()
    gids = [rank * 100_000 + i // 8 for i in range(n)]  # groups of 8
    return RolloutBatch.from_lists(prompts, comps, lps, rewards, gids, [True] * n, 0, 0)


def update_flops(config, batch) -> float:
    """Model FLOPs of one GRPO update of `batch` (forward + backward = 3 forwards, no
    recomputation counted, as MFU is defined): per token 6 x the parameters of every matrix
    product (the decoder's projections and the LM head; the embedding lookup is none), plus
    causal attention, 6 x layers x (heads x head_dim) x L^2 per sequence of L tokens
    (QK^T and PV, 2 x 2 x d x L^2 / 2 each way)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    d_head = getattr(config, "head_dim", None) or h // heads
    per_layer = h * d_head * (2 * heads + 2 * kv) + 3 * h * config.intermediate_size
    matmul_params = layers * per_layer + h * config.vocab_size
    lens = batch.seq_lens.double()
    return float(6 * matmul_params * lens.sum() + 6 * layers * heads * d_head * (lens**2).sum())


def print_profile(update, cuda: bool) -> dict:
    """torch.profiler over one update: the 25 most expensive operators by device time, and by
    host time (self, and with children: FSDP2's hooks, compiled regions); on a GPU the share of
    the update's wall time the device was busy (the union of its kernels' intervals)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        update()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    avg = prof.key_averages()
    key = "cuda_time_total" if cuda else "cpu_time_total"
    print(avg.table(sort_by=key, row_limit=25), file=sys.stderr, flush=True)
    print(avg.table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr, flush=True)
    print(avg.table(sort_by="cpu_time_total", row_limit=40), file=sys.stderr, flush=True)
    out = {"profiled_wall_s": wall,
           "host_self_cpu_s": sum(e.self_cpu_time_total for e in avg) / 1e6}
    if cuda:
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if getattr(e.device_type, "name", "") == "CUDA")
        busy, end = 0.0, -math.inf
        for a, b in spans:  # union of the device intervals, in microseconds
            if b > end:
                busy += b - max(a, end)
                end = b
        out["device_busy_s"] = busy / 1e6
    print(json.dumps({"profile": out}), file=sys.stderr, flush=True)
    return out


def sync_sites(update) -> dict[str, int]:
    """The places in one update where the host waits for the GPU (torch's sync debug mode):
    'file:line <- file:line ...' of the Python frames nearest the synchronising call -> count."""
    import collections
    import traceback
    import warnings

    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "warnings" not in f.filename][-4:]
        sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames))] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            update()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(sites.most_common())


def set_torch_config(item: str) -> None:
    """'torch._inductor.config.cpp_wrapper=True' -> setattr(torch._inductor.config,
    'cpp_wrapper', True): a torch knob tried in a bench run without a code change."""
    import ast
    import pkgutil

    target, _, value = item.partition("=")
    module, _, name = target.rpartition(".")
    if not module or not value:
        sys.exit(f"--torch-config {item!r}: expected MODULE.NAME=VALUE")
    try:  # a module, or an attribute of one (a config's nested class: ...config.triton)
        config = pkgutil.resolve_name(module)
    except (ImportError, AttributeError) as e:
        sys.exit(f"--torch-config {item!r}: {e}")
    if not hasattr(config, name):
        sys.exit(f"--torch-config {item!r}: {module} has no {name}")
    setattr(config, name, ast.literal_eval(value))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["tiny", "24m", "32k", "0.5b", "smollm2"], default="tiny")
    p.add_argument("--seqs", type=int, default=64, help="sequences per update, all ranks")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--completion-len", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--dtype", default="float32", help="compute dtype (model.dtype)")
    p.add_argument("--master-dtype", default="float32", help="trainer.master_dtype")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--mixed", action="store_true", help="long-tailed sequence lengths")
    p.add_argument("--groups", action="store_true",
                   help="without --mixed: the fixed lengths, a group of 8 sharing one prompt "
                        "(a GRPO batch's layout; --mixed always shares)")
    p.add_argument("--compare", action="store_true", help="padded vs packed + chunked head")
    p.add_argument("--budget", type=int, default=2048, help="tokens per packed micro-batch")
    p.add_argument("--nproc", type=int, default=1, help="trainer ranks with --compare")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override for every measured update (repeatable)")
    p.add_argument("--chunk-mib", type=float, default=None,
                   help="llamarl.trainer.policy.LOGPROB_CHUNK_MIB for the packed variant")
    p.add_argument("--profile", action="store_true",
                   help="print torch.profiler's top kernels of one timed GRPO update")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense peak for MFU (default: H100/H200 bf16 989)")
    p.add_argument("--sync-debug", action="store_true",
                   help="list where one timed GRPO update makes the host wait for the GPU")
    p.add_argument("--no-trace-varlen", action="store_true",
                   help="call the varlen attention from outside the compiled blocks")
    p.add_argument("--row-length-bound", action="store_true",
                   help="tell the varlen kernel the packed row's length as its longest "
                        "sequence (as before), not the true longest")
    p.add_argument("--unfused-head", action="store_true",
                   help="trainer.compile compiles the head's in-place softmax passes")
    p.add_argument("--recompute-logits", action="store_true",
                   help="the head's backward recomputes its logits (KEEP_LOGITS_MIB = 0)")
    p.add_argument("--keep-unsharded", action="store_true",
                   help="every block keeps its unsharded parameters from forward to backward "
                        "(FSDP2 reshard_after_forward=False: stable addresses for CUDA graphs)")
    p.add_argument("--label", default="", help="a name for this run in the output")
    p.add_argument("--torch-config", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="set a torch config value before anything compiles, e.g. "
                        "torch._inductor.config.cpp_wrapper=True (repeatable)")
    p.add_argument("--variant", choices=["both_algorithms", "padded", "packed", "grpo"],
                   default="both_algorithms",
                   help="grpo: the GRPO update alone, as the recipe's keys (and --set) say")
    args = p.parse_args()
    if args.compare:
        return compare(args)

    from llamarl.config import load_config
    from llamarl.trainer.critic import build_critic
    from llamarl.trainer.loop import TRAINER_BACKEND
    from llamarl.trainer.parts import load_reference
    from llamarl.trainer.policy import DTYPES, load_policy, shard_for_training
    from llamarl.trainer.rl_step import policy_step
    from llamarl.trainer.step import PolicyTrainer

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:  # as `python -m llamarl.launch` sets every CPU rank (runtime/allocator.py)
        from llamarl.runtime.allocator import keep_freed_memory
        keep_freed_memory()
    dist.init_process_group(TRAINER_BACKEND["cuda" if cuda else "cpu"])
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    path = build_model_dir(args.model) if rank == 0 else None
    dist.barrier()
    path = path or build_model_dir(args.model)

    from llamarl.trainer import policy as policy_mod
    from llamarl.trainer import varlen_attention

    for item in args.torch_config:
        set_torch_config(item)
    if args.no_trace_varlen:
        varlen_attention.TRACE_VARLEN = False
    if args.keep_unsharded:
        from llamarl.parallel import fsdp as fsdp_mod
        shard = fsdp_mod.fully_shard
        fsdp_mod.fully_shard = lambda m, **kw: shard(m, **{**kw, "reshard_after_forward": False})
    if args.row_length_bound:
        varlen_attention.PASS_LONGEST = False
    from llamarl.trainer import linear_logprobs as head
    if args.recompute_logits:
        head.KEEP_LOGITS_MIB = head.KEEP_LOGITS_MIB_CUDA = 0.0
    if args.unfused_head:
        head.FORWARD_FOR_COMPILE, head.GRAD_FOR_COMPILE = head._chunk_forward, head._chunk_grad

    variant = ["trainer.share_prompts=false"]  # padded rows, as measured before the option
    if args.variant == "grpo":
        variant = []
    elif args.variant == "padded":
        # whole logits, one softmax: as before the chunking
        policy_mod.LOGPROB_CHUNK_MIB = policy_mod.LOGPROB_CHUNK_MIB_CUDA = 0
    elif args.variant == "packed":
        variant = [f"trainer.max_tokens_per_micro_batch={args.budget}"]
        if args.chunk_mib is not None:
            policy_mod.LOGPROB_CHUNK_MIB = policy_mod.LOGPROB_CHUNK_MIB_CUDA = args.chunk_mib
    results = {}
    for alg in ("grpo", "ppo") if args.variant == "both_algorithms" else ("grpo",):
        extra = ["algorithm.name=ppo", "algorithm.kl_coef=0.01", "algorithm.kl_mode=reward",
                 "algorithm.kl_estimator=k1"] if alg == "ppo" else []
        extra += variant + args.set
        cfg = load_config(None, [f"trainer.micro_batch_size={args.micro_batch}",
                                 f"trainer.ranks={world}", f"model.dtype={args.dtype}",
                                 f"trainer.master_dtype={args.master_dtype}",
                                 f"trainer.gradient_checkpointing={args.gradient_checkpointing}",
                                 *extra])
        model = load_policy(path, args.master_dtype).to(device)
        vocab = model.config.vocab_size
        shard_for_training(model, mesh, cfg.trainer, DTYPES[args.dtype])
        trainer = PolicyTrainer(model, cfg.trainer, 100, world, device)
        critic = build_critic(cfg, path, mesh, device, 100, world) if alg == "ppo" else None
        reference = load_reference(cfg, path, mesh, device)
        batch = synthetic_batch(args, vocab, rank)
        pad = 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
        times = []
        for _ in range(args.repeats + 1):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            stats = policy_step(trainer, batch, cfg, pad, reference=reference, critic=critic)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        warmup_s, times = times[0], times[1:]  # the first is warm-up (reported apart)
        med = statistics.median(times)
        update = functools.partial(policy_step, trainer, batch, cfg, pad)
        profiled = sites = None
        if args.profile and alg == "grpo" and rank == 0:
            profiled = print_profile(update, cuda)
        if args.sync_debug and alg == "grpo" and cuda:
            sites = sync_sites(update)
        flops = update_flops(model.config, batch) * world  # every rank's batch is alike
        name = torch.cuda.get_device_name() if cuda else ""
        peak = args.peak_tflops or (989.0 if "H100" in name or "H200" in name else None)
        rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 2**20
        results[alg] = {"update_s": med, "trained_tokens_per_s": stats["n_tokens_all"] / med,
                        "padding_share": stats["padding_share"],
                        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda
                        else None, "cpu_peak_rss_growth_gib": None if cuda else rss,
                        "model_tflops_per_s": flops / med / 1e12 / world,
                        "mfu": flops / med / 1e12 / world / peak if peak else None,
                        "update_s_all": times, "warmup_update_s": warmup_s}
        if profiled:
            results[alg]["profile"] = profiled
        if sites is not None:
            results[alg]["sync_sites"] = sites
        del model, trainer, critic, reference
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        out = {"world": world, "device": torch.cuda.get_device_name() if cuda else "cpu",
               **vars(args), "results": results}
        if "ppo" in results:
            out["ppo_over_grpo_time"] = results["ppo"]["update_s"] / results["grpo"]["update_s"]
        print(json.dumps(out, indent=1), flush=True)
    dist.destroy_process_group()
    # as llamarl.launch does: a normal interpreter exit after destroy_process_group can abort
    # in finalization (torch 2.13, gloo; see tests/dist/trainer_world.py)
    sys.stderr.flush()
    os._exit(0)


def compare(args) -> None:
    """The padded and the packed GRPO update, each in a fresh torchrun, side by side."""
    passed, skip = [], False  # this run's arguments, but --compare and --nproc (torchrun's)
    for a in sys.argv[1:]:
        if skip or a == "--compare" or a.startswith("--nproc"):
            skip = a == "--nproc"
            continue
        passed.append(a)
    out = {"args": vars(args), "device": "cpu"}
    for variant in ("padded", "packed"):
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={args.nproc}", __file__, *passed, "--variant", variant],
            capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"the {variant} run failed:\n{proc.stderr[-3000:]}")
        if args.profile:
            print(f"--- {variant} ---\n{proc.stderr[-12000:]}", file=sys.stderr)
        run = json.loads(proc.stdout[proc.stdout.index("{"):])
        out["device"] = run["device"]
        out[variant] = run["results"]["grpo"]
    a, b = out["padded"], out["packed"]
    out["speedup"] = b["trained_tokens_per_s"] / a["trained_tokens_per_s"]
    key = "peak_mem_gib" if a["peak_mem_gib"] is not None else "cpu_peak_rss_growth_gib"
    out["peak_memory_ratio"] = a[key] / max(b[key], 1e-9)
    print(json.dumps(out, indent=1))
    name = f"trainer_packing_{args.model}_{'cpu' if out['device'] == 'cpu' else 'gpu'}.json"
    Path("bench/results", name).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
