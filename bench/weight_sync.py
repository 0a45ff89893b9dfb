"""Weight sync vs a raw broadcast of the same bytes between the same processes.

Launched by torchrun with 3 ranks (2 FSDP2 trainer ranks + 1 vLLM generator), through
llamarl's own runtime. Per round, timed on trainer 0 from the start of the publish until the
generator confirms through the store:
  sync: the training loop's path: every trainer rank publishes (trainer 0 announces the
        version in the store; each rank packs its FSDP2 shards and broadcasts them on its own
        group); the generator, blocked in WeightFollower.follow as between generation
        batches, wakes on the announcement, receives every bucket, writes the weights into
        the engine and resets the prefix cache (the weights are usable): everything a real
        sync costs;
  raw:  trainer 0 announces in the store and broadcasts one flat uint8 tensor of the model's
        byte count to the generator on the same group; the generator, blocked on the store
        key, wakes and receives it in the vLLM worker (collective_rpc).
Both end with the same acknowledgement (the generator sets a store key, trainer 0 waits on
it). Round 0 of each is a warm-up (and the sync's round 0 records the engine's load_weights,
see llamarl/parallel/load_replay.py). Reports medians and raw_s / sync_s (1.0 = the sync
costs no more than moving the bytes).

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
    from llamarl.launch.dist_env import from_environ
    from llamarl.launch.layout import compute_layout
    from llamarl.launch.runtime import setup

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", choices=["tiny", "100m"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    env = from_environ()
    model_dir = os.environ.get("BENCH_MODEL_DIR", "")
    cfg = load_config(None, [f"model.path={model_dir or 'tiny:reverse'}",
                             f"run.output_dir={tempfile.gettempdir()}/llamarl-bench-runs",
                             "generator.max_model_len=64", "generator.kv_cache_gib=0.1"])
    rt = setup(cfg, compute_layout(env.world_size, env.local_world_size, 2, 1, 1), env)
    if rt.role.role == "trainer":
        trainer(rt, args)
    else:
        generator(rt, args)
    rt.watchdog.mark_done()
    rt.watchdog.stop()
    os._exit(0)


def trainer(rt, args) -> None:
    from llamarl.parallel.fsdp import apply_fsdp
    from llamarl.parallel.groups import broadcast
    from llamarl.trainer.loop import init_trainer_group, open_weight_sender
    from llamarl.trainer.policy import load_policy

    mesh = init_trainer_group(rt)
    model_dir = build_model_dir(args.model) if rt.role.index == 0 else None
    if rt.role.index == 0:
        rt.store.set("bench/model", model_dir)
    model_dir = rt.wait_key("bench/model")
    model = load_policy(model_dir, "float32")
    apply_fsdp(model, mesh, torch.float32)
    sender = open_weight_sender(rt, model)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())  # full model
    flat = torch.ones(nbytes, dtype=torch.uint8)
    sync_s, raw_s, publish_s = [], [], []
    for i in range(args.rounds + 1):  # round 0 warms up both paths
        torch.distributed.barrier()
        t0 = time.perf_counter()
        sender.publish(model, version=i + 1)  # as the training loop does after a step
        t1 = time.perf_counter()
        if rt.role.index == 0:
            rt.wait_key(f"bench/loaded/{i}")
            sync_s.append(time.perf_counter() - t0)
            publish_s.append(t1 - t0)  # what the training loop waits for
        sender.wait()
        if rt.role.index == 0:
            t0 = time.perf_counter()
            rt.store.set(f"bench/raw/{i}", str(nbytes))
            broadcast(sender.group, flat, root=0)
            rt.wait_key(f"bench/raw_done/{i}")
            raw_s.append(time.perf_counter() - t0)
    if rt.role.index == 0:
        s, r = statistics.median(sync_s[1:]), statistics.median(raw_s[1:])
        report = {"model": args.model, "bytes": nbytes, "trainer_ranks": 2,
                  "rounds": args.rounds, "sync_s": s, "raw_s": r,
                  "publish_s": statistics.median(publish_s[1:]),
                  "load_s": float(rt.wait_key("bench/load_s")),
                  "sync_bytes_per_s": nbytes / s,
                  "raw_bytes_per_s": nbytes / r, "ratio_raw_over_sync": r / s}
        print("WEIGHT_SYNC " + json.dumps(report), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report))
        rt.store.set("bench/done", "1")


def generator(rt, args) -> None:
    from llamarl.generator.engine import Engine
    from llamarl.generator.loop import WeightFollower, join_weight_groups
    from llamarl.timeline import Timeline

    model_dir = rt.wait_key("bench/model")
    engine = Engine(model_dir, rt.cfg.generator, "float32", seed=0, on_cpu=rt.on_cpu)
    join_weight_groups(rt, engine)
    load_s = []
    receive_weights = engine.receive_weights

    def receive_and_confirm() -> None:
        """The follower's receive; the weights are usable in the engine when it returns."""
        t0 = time.perf_counter()
        receive_weights()
        load_s.append(time.perf_counter() - t0)
        rt.store.set(f"bench/loaded/{len(load_s) - 1}", "1")

    engine.receive_weights = receive_and_confirm
    weights = WeightFollower(rt, engine, None, Timeline(rt.run_dir, rt.role.rank, rt.role.name))
    for i in range(args.rounds + 1):
        weights.follow(need=i + 1)
        assert weights.version == i + 1, (weights.version, i)
        nbytes = int(rt.wait_key(f"bench/raw/{i}"))
        engine.llm.collective_rpc("llamarl_receive_raw", args=(nbytes,))
        rt.store.set(f"bench/raw_done/{i}", "1")
    rt.store.set("bench/load_s", str(statistics.median(load_s[1:])))  # receive + load + reset
    rt.wait_key("bench/done")


if __name__ == "__main__":
    main()
