"""Weight syncs to a tensor-parallel engine: every tp rank receiving the full tensors
(sync.reshard=false) against each tp rank receiving only the block of each tensor it loads
(sync.reshard=true, the default; llamarl/parallel/weight_plan.py: Needs).

The driver launches, one after the other and alternating, --cycles launches of each setting:
torchrun with 2 FSDP2 trainer ranks + one vLLM engine of tp 2 (4 ranks), through llamarl's own
runtime. In each launch the trainers change the weights (untimed, between barriers) and
publish them --rounds + 1 times (the first two are the warm-up: the first sync is always full
and recorded, the second is the first resharded one); a round is timed on trainer 0 from the
start of the publish until both tp ranks have the weights loaded in their engine. Reports, per
setting, the median sync time over all timed rounds, the bytes each tp rank received per sync
and their sum (the bytes moved), and the ratio of the two settings' medians, to
--out/weight_reshard.json.

    python bench/weight_reshard.py [--model 100m|tiny] [--rounds 8] [--cycles 2]
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weight_sync import sharded_policy  # noqa: E402  (bench/ is not a package)

ROOT = Path(__file__).resolve().parents[1]


def launch(reshard: bool, args) -> dict:
    out = Path(tempfile.mkdtemp(prefix="llamarl-reshard-")) / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           __file__, "--worker", "--reshard", str(reshard).lower(), "--model", args.model,
           "--rounds", str(args.rounds), "--result", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="100m", choices=["tiny", "100m"])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--reshard", default="true", help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    runs = {True: [], False: []}
    for _ in range(args.cycles):
        for reshard in (False, True):
            r = launch(reshard, args)
            runs[reshard].append(r)
            print(f"reshard={reshard}: median sync {statistics.median(r['sync_s']):.4f} s, "
                  f"{sum(r['received_bytes']) / 2**20:.1f} MiB moved per sync", flush=True)
    report = {"model": args.model, "rounds": args.rounds, "cycles": args.cycles,
              "trainer_ranks": 2, "tp": 2}
    for reshard, name in ((False, "full"), (True, "resharded")):
        times = [t for r in runs[reshard] for t in r["sync_s"]]
        report[name] = {"sync_s_median": statistics.median(times),
                        "received_bytes_per_tp_rank": runs[reshard][0]["received_bytes"],
                        "bytes_moved": sum(runs[reshard][0]["received_bytes"]),
                        "sent_bytes_per_trainer_rank": runs[reshard][0]["sent_bytes"]}
    report["time_ratio_resharded_over_full"] = (report["resharded"]["sync_s_median"]
                                                / report["full"]["sync_s_median"])
    report["bytes_ratio_resharded_over_full"] = (report["resharded"]["bytes_moved"]
                                                 / report["full"]["bytes_moved"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weight_reshard.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


def worker(args) -> None:
    from llamarl.config import load_config
    from llamarl.runtime.dist_env import from_environ
    from llamarl.runtime.layout import compute_layout
    from llamarl.runtime.setup import setup

    env = from_environ()
    cfg = load_config(None, ["model.path=tiny:reverse", "generator.tp=2",
                             f"sync.reshard={args.reshard}",
                             f"run.output_dir={tempfile.gettempdir()}/llamarl-bench-runs",
                             "generator.max_model_len=64", "generator.kv_cache_gib=0.1"])
    rt = setup(cfg, compute_layout(env.world_size, env.local_world_size, 2, 1, 2), env)
    (trainer if rt.role.role == "trainer" else generator)(rt, args)
    rt.watchdog.mark_done()
    rt.watchdog.stop()
    os._exit(0)


def trainer(rt, args) -> None:
    r = rt.role.index
    model, sender = sharded_policy(rt, args.model)
    times = []
    for i in range(args.rounds + 2):
        torch.distributed.barrier()
        with torch.no_grad():  # new weights every round, as after an optimizer step
            for p in model.parameters():
                p.add_(1e-3)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        sender.publish(model, version=i + 1)
        if r == 0:
            for k in range(2):
                rt.wait_key(f"bench/loaded/{k}/{i}")
            if i >= 2:  # warm-up: the first (full, recorded) sync and the first resharded one
                times.append(time.perf_counter() - t0)
        sender.wait()
    rt.store.set(f"bench/sent/{r}", json.dumps(sender.bytes_last_sync))
    if r == 0:
        received = [int(rt.wait_key(f"bench/received/{k}")) for k in range(2)]
        sent = [json.loads(rt.wait_key(f"bench/sent/{t}")) for t in range(2)]
        Path(args.result).write_text(json.dumps({"sync_s": times, "received_bytes": received,
                                                 "sent_bytes": sent}))
        rt.store.set("bench/done", "1")


def generator(rt, args) -> None:
    """Both tp ranks receive and load each sync themselves, in the same order (loading calls
    no collective of the engine, so no leader needs to drive them)."""
    from llamarl.generator.engine import Engine
    from llamarl.generator.loop import engine_world, join_weight_groups
    from llamarl.parallel.weight_sync import announced_version

    k = rt.role.tp_rank
    engine = Engine(rt.wait_key("bench/model"), rt.cfg.generator, "float32", seed=0,
                    on_cpu=rt.on_cpu, world=engine_world(rt))
    join_weight_groups(rt, engine)
    for i in range(args.rounds + 2):
        rt.wait_key(f"wsync/version/{i}")
        engine.post_weights()
        engine.load_posted_weights(announced_version(rt.store, i))
        rt.store.set(f"bench/loaded/{k}/{i}", "1")
    rt.store.set(f"bench/received/{k}", str(engine.worker._llamarl_receiver.bytes_per_sync))
    rt.wait_key("bench/done")


if __name__ == "__main__":
    main()
