"""The update's micro-batch layouts side by side in one process: the same GRPO update of the
same batch, the layouts taking turns, so the machine's drift hits all alike.

    given           padded rows in the batch's order (groups of one prompt each)
    by_length       padded rows of similar lengths together (`rl_step.by_length`)
    shared_prompts  each group one row, its prompt computed once (trainer.share_prompts: true)
    auto            trainer.share_prompts: auto (the default) choosing between the two
    *_repeat_kv     (tiny) the same with the key/value heads repeated for every masked
                    attention call, as Hugging Face's sdpa does, instead of llamarl_sdpa's
                    grouped heads (trainer/varlen_attention.py)

Workload `tiny` (the default): the default recipe's shapes, the embedded tiny model, 64
prompts x 8 samples, prompts of 8-15 tokens (one length per group), completions of 1-12
tokens, micro-batches of 64 rows (and 256, `*_256`). Workload `gen24m`: long answers, where
the shared layout's dense square costs: bench/peer_trl.py's 24M model, 8 prompts x 8
samples, prompts of 10-15 tokens, completions of 64-128, micro-batches of 32 rows. One FSDP2
rank on the process's threads. Reports, per layout, the median and the minimum seconds per
update over --repeats, the share of the computed tokens that are padding, the share of
micro-batches that ran shared, and the ratio of each median to by_length's; written to
bench/results/micro_batch_order.json (tiny) or micro_batch_order_gen24m.json, with the
schema's keys of bench/harness.py.

    python bench/micro_batch_order.py                     # part of make bench
    python bench/micro_batch_order.py --workload gen24m   # part of make bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from harness import RESULTS, bench_parser, write_result
from torch.distributed.device_mesh import init_device_mesh


def recipe_batch(prompts: int, samples: int, vocab: int, seed: int,
                 prompt_len: tuple[int, int] = (8, 15), completion_len: tuple[int, int] = (1, 12)):
    """A RolloutBatch of `prompts` groups of `samples`: prompt lengths uniform in `prompt_len`
    (one per group), completion lengths uniform in `completion_len` (per sample), random
    tokens and rewards."""
    from llamarl.buffer.record import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    ps, cs, lps, rewards, gids = [], [], [], [], []
    for p in range(prompts):
        n = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=g))
        prompt = torch.randint(3, vocab, (n,), generator=g).tolist()
        for _ in range(samples):
            c = int(torch.randint(completion_len[0], completion_len[1] + 1, (1,), generator=g))
            ps.append(prompt)
            cs.append(torch.randint(3, vocab, (c,), generator=g).tolist())
            lps.append((-torch.rand(c, generator=g)).tolist())
            rewards.append(float(torch.rand(1, generator=g)))
            gids.append(p)
    return RolloutBatch.from_lists(ps, cs, lps, rewards, gids, [True] * len(ps), 0, 0)


PADDED = ["trainer.share_prompts=false"]
SHARED = ["trainer.share_prompts=true"]
# workload -> (description, micro-batch rows, batch shape, layouts: name -> recipe overrides)
WORKLOADS = {
    "tiny": ("tiny model, 64 prompts x 8 samples, prompts 8-15 tokens, completions 1-12, "
             "micro-batches of 64 rows (256: shared_prompts_256), 1 FSDP2 rank", 64,
             dict(prompts=64, samples=8),
             {"given": PADDED, "by_length": PADDED, "shared_prompts": SHARED,
              "shared_prompts_256": SHARED + ["trainer.micro_batch_size=256"],
              "auto_256": ["trainer.micro_batch_size=256"],
              "auto_256_repeat_kv": ["trainer.micro_batch_size=256"],
              "by_length_repeat_kv": PADDED}),
    "gen24m": ("24M Qwen2 (bench/peer_trl.py's generation-heavy model), 8 prompts x 8 samples, "
               "prompts 10-15 tokens, completions 64-128, micro-batches of 32 rows, 1 FSDP2 "
               "rank", 32, dict(prompts=8, samples=8, prompt_len=(10, 15),
                                completion_len=(64, 128)),
               {"by_length": PADDED, "shared_prompts": SHARED, "auto": []}),
}


def one_rank_and_model(workload: str, threads: int) -> Path:
    """This process as one gloo rank on `threads` threads, and the workload's model saved as
    the trainer loads it (llamarl_sdpa): `tiny` in a new temporary directory (remove its
    parent when done), `gen24m` bench/peer_trl.py's 24M model (kept between runs)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=0, world_size=1)
    if workload == "tiny":
        from llamarl.tiny.model import build_model, save_hf_dir

        model, tok = build_model(0)
        path = Path(tempfile.mkdtemp(prefix="llamarl-bench-tiny-")) / "model"
        save_hf_dir(path, model.state_dict(), model.config, tok)
        return path
    from peer_trl import build_gen_model

    return Path(build_gen_model(Path(tempfile.gettempdir()) / "llamarl-bench-gen24m"))


def finish(bench: str, args: argparse.Namespace, out: dict, path: Path) -> None:
    """Write `out` to --out, by default bench/results/<bench>[_<workload>].json (no suffix for
    tiny), remove the tiny model's temporary directory, leave the process group."""
    suffix = "" if args.workload == "tiny" else f"_{args.workload}"
    written = write_result(bench, out, args, out=args.out or RESULTS / f"{bench}{suffix}.json")
    print(f"wrote {written}")
    if args.workload == "tiny":
        shutil.rmtree(path.parent, ignore_errors=True)
    dist.destroy_process_group()


def setup(bench: str, doc: str, what: str, gen24m_repeats: int
          ) -> tuple[argparse.Namespace, int, Path]:
    """A side-by-side update bench's command line (harness's --out and --notes; --workload tiny
    | gen24m, --repeats: updates per `what`, default 15 tiny, `gen24m_repeats` gen24m;
    --threads), its repeats, and this process as one rank with the workload's model
    (one_rank_and_model)."""
    p = bench_parser(bench, doc, out="")  # --out's default depends on the workload (finish)
    p.add_argument("--workload", choices=tuple(WORKLOADS), default="tiny")
    p.add_argument("--repeats", type=int, default=None, help=f"updates per {what} "
                   f"(default 15 tiny, {gen24m_repeats} gen24m)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    repeats = args.repeats or {"tiny": 15, "gen24m": gen24m_repeats}[args.workload]
    return args, repeats, one_rank_and_model(args.workload, args.threads)


def main() -> None:
    args, repeats, path = setup("micro_batch_order", __doc__, "layout", 5)
    from transformers import AutoTokenizer

    from llamarl.config import load_config
    from llamarl.parallel.fsdp import apply_fsdp
    from llamarl.trainer import rl_step, varlen_attention
    from llamarl.trainer.policy import load_policy
    from llamarl.trainer.step import PolicyTrainer

    what, rows, shape, layouts = WORKLOADS[args.workload]
    base = [f"trainer.micro_batch_size={rows}", "trainer.ranks=1"]
    model, tok = load_policy(str(path), "float32"), AutoTokenizer.from_pretrained(path)
    apply_fsdp(model, init_device_mesh("cpu", (1,)), torch.float32)
    cfg = load_config(None, base)
    trainer = PolicyTrainer(model, cfg.trainer, 10_000, 1, torch.device("cpu"))
    batch = recipe_batch(vocab=model.config.vocab_size, seed=0, **shape)
    sort = rl_step.by_length
    gqa = varlen_attention._cpu_masked_gqa
    def repeat_kv(*args):  # noqa: E306 - Hugging Face's choice: repeat the heads
        return False
    cfgs = {name: load_config(None, base + extra) for name, extra in layouts.items()}
    times = {name: [] for name in layouts}
    padding, shared = {}, {}
    for i in range(repeats + 1):
        for name in layouts:
            # "given": padded rows in the batch's order
            rl_step.by_length = (lambda idx, lens: idx) if name == "given" else sort
            varlen_attention._cpu_masked_gqa = repeat_kv if name.endswith("_repeat_kv") else gqa
            t0 = time.perf_counter()
            stats = rl_step.policy_step(trainer, batch, cfgs[name], tok.pad_token_id)
            if i:  # the first of each is warm-up
                times[name].append(time.perf_counter() - t0)
            padding[name], shared[name] = stats["padding_share"], stats["shared_prompts"]
    rl_step.by_length = sort
    varlen_attention._cpu_masked_gqa = gqa
    out = {"workload": what, "threads": args.threads, "repeats": repeats}
    for name in layouts:
        out[name] = {"update_s_median": statistics.median(times[name]),
                     "update_s_min": min(times[name]), "padding_share": padding[name],
                     "shared_prompts": shared[name], "update_s_all": times[name]}
    for name in layouts:
        if name.endswith("_repeat_kv"):  # Hugging Face's repeat against the grouped heads
            grouped = out[name.removesuffix("_repeat_kv")]["update_s_median"]
            out[f"{name.removesuffix('_repeat_kv')}_grouped_over_repeat_kv"] = (
                grouped / out[name]["update_s_median"])
        if name != "by_length":
            out[f"{name}_over_by_length"] = (out[name]["update_s_median"]
                                             / out["by_length"]["update_s_median"])
    print(json.dumps(out, indent=1))
    finish("micro_batch_order", args, out, path)


if __name__ == "__main__":
    main()
