"""Weight sync vs a raw broadcast of the same bytes between the same processes.

Launched by torchrun with 3 ranks (2 FSDP2 trainer ranks + 1 vLLM generator), through
llamarl's own runtime. Per round, timed on trainer 0 from the start of the publish until the
generator confirms through the store:
  sync: the training loop's path: every trainer rank publishes (trainer 0 announces the
        version in the store; each rank packs its FSDP2 shards (but those that live in its send
        buffers, see fsdp.place_shards) and sends them on its own group: gloo point-to-point
        messages on CPU); the generator, blocked in WeightFollower.follow as between
        generation batches, wakes on the announcement, posts the receives of every bucket
        (unless the last load posted them already: the tiny model, see
        WeightReceiver._post_next), reads the version while they travel and writes the
        weights into the engine (the weights are usable): everything a real sync costs but
        the prefix-cache reset, which the engine's next generate call does
        (Engine.load_posted_weights; ~0.1 ms on the 2-core CPU, not timed);
  raw:  the same transfers with nothing around them: trainer 0 announces in the store, and
        every trainer rank broadcasts its shards' byte count (uint8) on its own group, in
        parallel, in 64 MB messages (RAW_CHUNK_MB: on this machine 64 MB messages move 1.4x
        faster than one 219 MB message); the generator, blocked on the store key, wakes and
        receives them in the vLLM worker (called directly, as the sync does);
  raw_p2p: the same as gloo point-to-point messages, every one posted at once (how a sync
        travels on gloo, see parallel.groups.point_to_point): the strictest baseline, the
        sync's own wire with nothing around it;
  raw_single: trainer 0 alone broadcasts every byte of the model in one message (the
        baseline of the first measurements: a weaker one for large models).
All end with the same acknowledgement (the generator sets a store key, trainer 0 waits on
it). Each kind runs in blocks of --rounds + 1 rounds of its own, the first a warm-up (the
very first sync records the engine's load_weights, see llamarl/parallel/load_replay.py),
and the four blocks repeat --cycles times, so that every kind is measured through the
machine's slow and fast spells alike. Every sync round first changes the weights (untimed,
with both trainers before and after it in a barrier: nothing else runs while a round is
timed); after the last one the engine's weights must sum to the trainer's. Reports medians
over all timed rounds and raw_s / sync_s (1.0 = the sync costs no more than moving the same
bytes between the same processes the same way), raw_p2p_s / sync_s and raw_single_s /
sync_s, and the raw / sync ratio of each cycle's medians.

    torchrun --standalone --nproc-per-node 3 bench/weight_sync.py --model tiny|100m
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def build_model_dir(kind: str) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from llamarl.tiny.model import build_model, build_tokenizer, save_hf_dir

    path = Path(tempfile.gettempdir()) / f"llamarl-bench-{kind}"
    if (path / "config.json").exists():
        return str(path)
    if kind == "tiny":
        model, tok = build_model(0)
    else:  # ~110M parameters: hidden 768, 12 layers, 32k vocab (tied)
        tok = build_tokenizer()
        cfg = Qwen2Config(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                          num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                          max_position_embeddings=256, tie_word_embeddings=True,
                          bos_token_id=1, eos_token_id=2, pad_token_id=0)
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
    save_hf_dir(path, model.state_dict(), model.config, tok)
    return str(path)


def main() -> None:
    from llamarl.config import load_config
    from llamarl.runtime.dist_env import from_environ
    from llamarl.runtime.layout import compute_layout
    from llamarl.runtime.setup import setup

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", choices=["tiny", "100m"])
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per block")
    ap.add_argument("--cycles", type=int, default=3, help="repeats of the four blocks")
    ap.add_argument("--bucket-mb", type=int, default=None, help="sync.bucket_mb (recipe default)")
    ap.add_argument("--solo-mb", type=float, default=None,
                    help="sync.solo_mb: shards this large travel alone (recipe default)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    env = from_environ()
    model_dir = os.environ.get("BENCH_MODEL_DIR", "")
    cfg = load_config(None, [f"model.path={model_dir or 'tiny:reverse'}",
                             f"run.output_dir={tempfile.gettempdir()}/llamarl-bench-runs",
                             "generator.max_model_len=64", "generator.kv_cache_gib=0.1"]
                      + ([f"sync.bucket_mb={args.bucket_mb}"] if args.bucket_mb else [])
                      + ([f"sync.solo_mb={args.solo_mb}"] if args.solo_mb else []))
    rt = setup(cfg, compute_layout(env.world_size, env.local_world_size, 2, 1, 1), env)
    if rt.role.role == "trainer":
        trainer(rt, args)
    else:
        generator(rt, args)
    rt.watchdog.mark_done()
    rt.watchdog.stop()
    os._exit(0)


# On this machine gloo moves 219 MB fastest as 64 MB messages (1.4x faster than as one
# message, ~15% faster than as 16 MB ones): raw always gets that.
RAW_CHUNK_MB = 64
# Measured one after the other, each in a block of rounds (a warm-up first): the sync in its
# steady state, as in training, and each raw transfer in its own. (Interleaved round by round,
# a 1 ms transfer took up to 2x as long depending on which one went before it.)
METHODS = ("sync", "raw", "raw_p2p", "raw_single")


def sharded_policy(rt, kind: str):
    """The bench model (--model `kind`) in float32, FSDP2-sharded over the trainer ranks, and
    this rank's weight sender (the training loop's own)."""
    from llamarl.parallel.fsdp import apply_fsdp
    from llamarl.parallel.weight_sync import open_sender
    from llamarl.trainer.loop import init_trainer_group
    from llamarl.trainer.policy import load_policy

    mesh = init_trainer_group(rt)
    if rt.role.index == 0:
        rt.store.set("bench/model", build_model_dir(kind))
    model = load_policy(rt.wait_key("bench/model"), "float32")
    apply_fsdp(model, mesh, torch.float32)
    return model, open_sender(rt, model)


def trainer(rt, args) -> None:
    from llamarl.parallel.groups import broadcast, post_to_all
    from llamarl.parallel.weight_plan import OTHER_TAGS

    r = rt.role.index
    model, sender = sharded_policy(rt, args.model)
    rt.store.set(f"bench/shard_bytes/{r}", str(sender.bytes_per_sync))
    shares = [int(rt.wait_key(f"bench/shard_bytes/{t}")) for t in range(rt.layout.trainer_ranks)]
    nbytes = sum(shares)  # the whole model: every trainer's shards
    share = torch.ones(shares[r], dtype=torch.uint8)
    chunk = RAW_CHUNK_MB << 20  # raw's best message size, whatever the sync's buckets
    whole = torch.ones(nbytes, dtype=torch.uint8) if r == 0 else None
    # times[method][cycle]: the timed rounds of that block (its warm-up left out)
    times: dict[str, list[list[float]]] = {m: [] for m in METHODS}
    publish_s: list[float] = []
    version = 0
    for cycle in range(args.cycles):
        for method in METHODS:  # a block of its own rounds, round 0 a warm-up
            block = []
            for i in range(args.rounds + 1):
                key = f"{cycle}/{i}"
                torch.distributed.barrier()  # the last round is over on both trainers
                if method == "sync":
                    with torch.no_grad():  # new weights every round, as after an optimizer step
                        for p in model.parameters():
                            p.add_(1e-3)
                torch.distributed.barrier()
                t0 = time.perf_counter()
                if method == "sync":
                    version += 1
                    sender.publish(model, version=version)  # as the training loop does
                    t1 = time.perf_counter()
                    if r == 0:
                        rt.wait_key(f"bench/loaded/{version - 1}")
                        if i:
                            publish_s.append(t1 - t0)  # what the training loop waits for
                    sender.wait()
                elif method in ("raw", "raw_p2p"):  # every trainer its share, in parallel
                    if r == 0:
                        rt.store.set(f"bench/{method}/{key}", json.dumps([shares, chunk]))
                    works = [w for j, c in enumerate(share.split(chunk))
                             for w in post_to_all(sender.transport.group, c, OTHER_TAGS + j,
                                                  p2p=method == "raw_p2p")]
                    for work in works:
                        work.wait()
                    if r == 0:
                        rt.wait_key(f"bench/{method}_done/{key}")
                elif r == 0:  # raw_single: trainer 0 sends every byte in one broadcast
                    rt.store.set(f"bench/{method}/{key}", json.dumps([[nbytes], nbytes]))
                    broadcast(sender.transport.group, whole, root=0)
                    rt.wait_key(f"bench/{method}_done/{key}")
                if i:
                    block.append(time.perf_counter() - t0)
            times[method].append(block)
    with torch.no_grad():  # a collective: both trainer ranks
        checksum = sum(float(p.full_tensor().double().sum()) for p in model.parameters())
    if r == 0:
        engine_sum = float(rt.wait_key("bench/checksum"))
        if abs(engine_sum - checksum) > 1e-9 * max(1.0, abs(checksum)):
            raise RuntimeError(f"the engine's weights differ from the trainer's after the last "
                               f"sync: sum {engine_sum} vs {checksum}")
        med = {f"{m}_s": statistics.median(t for block in v for t in block)
               for m, v in times.items()}
        med["publish_s"] = statistics.median(publish_s)
        per_cycle = [statistics.median(raw) / statistics.median(sync)
                     for raw, sync in zip(times["raw"], times["sync"])]
        report = {"model": args.model, "bytes": nbytes, "trainer_ranks": rt.layout.trainer_ranks,
                  "bucket_mb": rt.cfg.sync.bucket_mb, "solo_mb": rt.cfg.sync.solo_mb,
                  "buckets": len(sender.buckets), "sent_as_is": sum(sender.direct),
                  "rounds": args.rounds, "cycles": args.cycles, **med,
                  "load_s": float(rt.wait_key("bench/load_s")),
                  "sync_bytes_per_s": nbytes / med["sync_s"],
                  "raw_bytes_per_s": nbytes / med["raw_s"],
                  "ratio_raw_over_sync": med["raw_s"] / med["sync_s"],
                  "ratio_raw_p2p_over_sync": med["raw_p2p_s"] / med["sync_s"],
                  "ratio_raw_single_over_sync": med["raw_single_s"] / med["sync_s"],
                  "ratio_raw_over_sync_per_cycle": per_cycle}
        print("WEIGHT_SYNC " + json.dumps(report), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report))
        rt.store.set("bench/done", "1")


def generator(rt, args) -> None:
    from llamarl.generator.engine import Engine
    from llamarl.generator.loop import join_weight_groups
    from llamarl.generator.weights import WeightFollower
    from llamarl.timeline import Timeline

    engine = Engine(rt.wait_key("bench/model"), rt.cfg.generator, "float32", seed=0,
                    on_cpu=rt.on_cpu)
    join_weight_groups(rt, engine)
    load_s = []
    posted_at = []
    post_weights, load_posted_weights = engine.post_weights, engine.load_posted_weights

    def post() -> None:
        """The follower's receive starts: the receives are posted."""
        posted_at.append(time.perf_counter())
        post_weights()

    def load_and_confirm(version: int | None = None) -> None:
        """The follower's receive ends: the weights are usable in the engine."""
        load_posted_weights(version)
        load_s.append(time.perf_counter() - posted_at[-1])
        rt.store.set(f"bench/loaded/{len(load_s) - 1}", "1")

    engine.post_weights, engine.load_posted_weights = post, load_and_confirm
    weights = WeightFollower(rt, engine, None, Timeline(rt.run_dir, rt.role.rank, rt.role.name))
    for cycle in range(args.cycles):  # the trainers' blocks, in the same order
        for method in METHODS:
            if method == "sync":
                last = (cycle + 1) * (args.rounds + 1)
                while weights.version < last:
                    # loads every announced version (the next may be announced the moment
                    # one is confirmed)
                    weights.follow(need=weights.version + 1)
                assert weights.version == last == len(load_s), (weights.version, len(load_s))
                continue
            for i in range(args.rounds + 1):
                key = f"{cycle}/{i}"
                sizes, chunk = json.loads(rt.wait_key(f"bench/{method}/{key}"))
                engine.worker.llamarl_receive_raw(sizes, chunk, method == "raw_p2p")
                rt.store.set(f"bench/{method}_done/{key}", "1")
    rt.store.set("bench/checksum", str(engine.checksum()))  # the last sync's weights
    timed = [s for k, s in enumerate(load_s) if k % (args.rounds + 1)]  # no warm-ups
    rt.store.set("bench/load_s", str(statistics.median(timed)))  # receive + load + reset
    rt.wait_key("bench/done")


if __name__ == "__main__":
    main()
