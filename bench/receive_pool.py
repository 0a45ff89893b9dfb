"""An engine's receive-buffer bytes and sync time with a pool of K buffers (sync.receive_buffers,
parallel/receive_pool.py) against a buffer per bucket (K = 0), one sender.

One process: a vLLM engine on the CPU (in-process, generator/engine.py), and the trainer's
model (Hugging Face, float32) sending through a WeightSender on one side of a real gloo pair,
its receiver (WeightReceiver) on the other, into the engine's model (vLLM's load_weights on
the first sync, recorded; replayed after). Every K gets the same series of syncs (the
trainer's weights shifted by a known amount before each), timed from the publish to the end
of the load; the K's take turns sync by sync (each with its own sender and gloo pair, all
into the one engine), so the shared machine's slow spells hit them alike. Reports per K:
the largest receive-buffer bytes the receiver held (the first sync's pool, or every
bucket's buffer), what it holds after the first sync (buckets received straight into the
engine need none), the median and least sync seconds (the first, recorded, apart), and
a digest of the engine's weights after every sync, which must be the same for every K.

    python bench/receive_pool.py --model tiny|smollm2 [--syncs 8] [--bucket-mb 64]
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from datetime import timedelta

from harness import ROOT, bench_parser, median, write_result

sys.path.insert(0, str(ROOT))


def model_dir(kind: str) -> str:
    if kind == "tiny":
        from weight_sync import build_model_dir

        return build_model_dir("tiny")
    from llamarl.models.smollm2 import ensure_smollm2

    return str(ensure_smollm2("135m-instruct"))


def gloo_pair():
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=120),
                           wait_for_workers=False)
    groups = [None, None]

    def join(rank):
        store = server if rank == 0 else dist.TCPStore(
            "127.0.0.1", server.port, None, False, timeout=timedelta(seconds=120))
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("wsync0", store), rank, 2,
                                             timedelta(seconds=120))
    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return server, groups


def digest(model) -> str:
    h = hashlib.sha1()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy())
    return h.hexdigest()[:16]


class Side:
    """One K's trainer model, sender and receiver, on a gloo pair of their own."""

    def __init__(self, directory: str, k: int, bucket_mb: int, solo_mb: float):
        import torch
        from transformers import AutoModelForCausalLM

        from llamarl.parallel.transports.torch_dist import Receiver, Sender
        from llamarl.parallel.weight_receiver import WeightReceiver
        from llamarl.parallel.weight_sender import WeightSender

        self.k = k
        self.server, (root, group) = gloo_pair()
        self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        cpu = torch.device("cpu")
        self.sender = WeightSender(self.model, 0, bucket_mb, Sender.over(root), cpu,
                                   solo_mb=solo_mb)
        self.receiver = WeightReceiver([self.sender.metas], bucket_mb, Receiver.over([group]),
                                       cpu, solo_mb, receive_buffers=k)
        self.seconds, self.digests, self.held = [], [], []

    def sync(self, i: int, target) -> None:
        """Sync i: shift the trainer's weights by 1e-3 (i + 1), send, receive into `target`."""
        import torch

        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1e-3 * (i + 1))
        start = time.perf_counter()
        sender = self.sender
        sent = threading.Thread(target=lambda: (sender.publish(self.model, None), sender.wait()))
        sent.start()
        self.receiver.receive(target)
        sent.join()
        self.seconds.append(time.perf_counter() - start)
        self.held.append(self.receiver.buffer_bytes)
        self.digests.append(digest(target))

    def result(self) -> dict:
        r, plan = self.receiver, self.receiver.plans[0]
        return {"receive_buffers": self.k, "buckets": len(plan),
                "largest_bucket_bytes": max(b.numel * 4 for b in plan),
                "model_bytes": sum(b.numel * 4 for b in plan),
                "peak_buffer_bytes": r.peak_buffer_bytes if r.pool is not None else self.held[0],
                "buffer_bytes_after_first_sync": self.held[-1],
                "replayed": r.replay is not None,
                "first_sync_s": self.seconds[0], "sync_s_median": median(self.seconds[1:]),
                "sync_s_min": min(self.seconds[1:]),
                "sync_s": self.seconds, "digests": self.digests}


def main() -> None:
    ap = bench_parser("receive_pool", __doc__, out="")
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    ap.add_argument("--syncs", type=int, default=8)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--solo-mb", type=float, default=1.0)
    ap.add_argument("--pools", default="0,4,2")
    args = ap.parse_args()
    if not args.out:
        args.out = str(ROOT / "bench" / "results" / f"receive_pool_{args.model}.json")
    from llamarl.config import load_config
    from llamarl.generator.engine import Engine

    directory = model_dir(args.model)
    cfg = load_config(None, [f"model.path={directory}", "generator.max_model_len=128"])
    engine = Engine(directory, cfg.generator, "float32", seed=0, on_cpu=True)
    sides = [Side(directory, int(k), args.bucket_mb, args.solo_mb)
             for k in args.pools.split(",")]
    target = engine.worker.model_runner.model
    for i in range(args.syncs):  # the pools take turns: the machine's drift hits all alike
        for side in sides:
            side.sync(i, target)
    runs = [side.result() for side in sides]
    same = all(r["digests"] == runs[0]["digests"] for r in runs)
    base = runs[0]
    out = {"model": args.model, "weights_identical_across_pools": same, "runs": runs,
           "sync_s_ratio_to_k0": {r["receive_buffers"]: r["sync_s_median"] / base["sync_s_median"]
                                  for r in runs}}
    for r in runs:
        print(f"K={r['receive_buffers']}: {r['buckets']} buckets, "
              f"min {r['sync_s_min']:.4f} s, peak "
              f"{r['peak_buffer_bytes'] / 2**20:.1f} MiB (model {r['model_bytes'] / 2**20:.1f}), "
              f"after {r['buffer_bytes_after_first_sync'] / 2**20:.2f} MiB, first "
              f"{r['first_sync_s']:.3f} s, median {r['sync_s_median']:.4f} s", flush=True)
    print("identical weights:", same)
    write_result("receive_pool", out, args)


if __name__ == "__main__":
    main()
