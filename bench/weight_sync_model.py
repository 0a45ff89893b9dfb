"""An estimate, not a measurement: the weight-sync time of Qwen2.5-7B (7.62e9 parameters, bf16,
B = 15.23 GB) at 64 and 1024 GPUs, for two schemes, with every assumption printed and written
to bench/results/weight_sync_model.json. No GPU has run either scheme at this size.

Schemes (T trainer ranks, E engines of tp GPUs; N = E x tp engine GPUs):
  every  (today, parallel/weight_sync.py): trainer rank r broadcasts its FSDP2 dim-0 shards on
         its own communicator [trainer r, every engine GPU] (with tp > 1 resharded: one per
         tp rank k, [trainer r, tp rank k of every engine], each B / (T tp)); messages as
         weight_plan.plan_buckets packs them (shards >= sync.solo_mb alone, the rest in
         sync.bucket_mb buckets). Engines receive sender by sender (weight_receiver.py), so one
         sender NIC feeds the fleet at a time. The ring fill is paid once when successive
         senders' broadcasts run as a wavefront, or once per sender when they do not.
  one    (the GPU default being built): the trainers all-gather each full 64 MiB bucket (ring
         over T ranks), then trainer 0 alone ring-broadcasts it to all N engine GPUs on one
         communicator; the gather of bucket b+1 overlaps the broadcast of bucket b (two
         communicators), so the time is a two-stage pipeline: the first gather, then per bucket
         the slower stage, then the broadcast ring's fill once (the root's kernel ends when its
         last chunk leaves: a wavefront down the ring).

Per transfer:  t = bytes / beta + hops x (t_chunk + C / beta) + messages x delta
  beta     one sender's ring bandwidth, 12 / 25 / 45 GB/s (NVIDIA/nccl#590: one channel;
           verl-project/verl#7167: verl's measured single-sender cap; one 400G NIC)
  t_chunk  latency of one pipeline step across a node boundary, 12-50 us (NVIDIA/nccl#2409:
           10-12 us fixed per step; NCCL's tuning model 28-50 us)
  t_nvl    the same across NVLink inside a node (NCCL's tuning model, Simple protocol: ~4 us)
  C        NCCL's pipeline chunk: NCCL_BUFFSIZE 4 MiB / NCCL_STEPS 8 = 512 KiB; a message is cut
           into ceil(size / C) steps and the first step needs one hop per ring rank to reach
           the last (the fill); later steps stream behind it
  delta    per message at each receiver (launch, rendezvous), 10-30 us
  hops     'flat': every ring hop costs t_chunk (the brief's (n-1) x t_chunk, the worst case);
           'nodes': 8 GPUs a node, ring order node by node, so (nodes - 1) hops cross a node
           boundary (t_chunk) and the rest are NVLink (t_nvl)
Sources: ../shared/scale_review.md section 3.

The gloo calibration (--calibrate FILE...): bench/weight_sync.py's reports at two model sizes
(raw_single: trainer 0 sends all B bytes in one message to one engine, a ring of 2), fitted to
t = B / beta + delta exactly (two sizes, two unknowns), then the model's predictions of the other
kinds (raw: B as 64 MiB messages from 2 senders; raw_p2p; sync: the plan's messages) against
their measured times. This calibrates the form on loopback gloo (CPU memcpy, 2 shared cores),
not NCCL's constants: those stay the public figures above.

    python bench/weight_sync_model.py [--calibrate bench/results/weight_sync_gloo_tiny.json ...]
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from llamarl.parallel.weight_plan import TensorMeta, plan_buckets

GB = 1e9
MIB = 1 << 20
GPUS_PER_NODE = 8
CHUNK_BYTES = 4 * MIB // 8  # NCCL_BUFFSIZE / NCCL_STEPS, Simple protocol
T_NVLINK_S = 4e-6
BUCKET_BYTES = 64 * MIB  # sync.bucket_mb
SOLO_BYTES = 1 * MIB  # sync.solo_mb
TARGET = 1.5  # the `one` scheme's target: within 1.5 x one NIC's bound B / beta

QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                 tie_word_embeddings=False)

# (name, T, E, tp)
LAYOUTS = [("16 GPUs", 8, 8, 1), ("64 GPUs", 32, 32, 1), ("1024 GPUs", 256, 768, 1),
           ("1024 GPUs tp 8", 256, 96, 8)]


@dataclass(frozen=True)
class Link:
    """One point of the parameter space (seconds, bytes per second)."""

    beta: float
    t_chunk: float
    delta: float
    hops: str = "nodes"  # 'flat' or 'nodes' (module docstring)
    t_nvl: float = T_NVLINK_S
    chunk: int = CHUNK_BYTES


def qwen_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every parameter's full shape in a Qwen2 model of `config`."""
    h, v, inter = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    head_dim = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.q_proj.bias": (q,),
                       p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
                       p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter),
                       p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def model_bytes(config: dict = QWEN25_7B) -> int:
    return 2 * sum(math.prod(s) for s in qwen_shapes(config).values())  # bf16


def sender_messages(senders: int, config: dict = QWEN25_7B, tp: int = 1) -> list[int]:
    """The sizes (bytes) of the messages trainer rank 0 of `senders` sends in a sync under the
    `every` scheme: its dim-0 shard of every tensor (FSDP2 Shard(0)), packed by the real
    weight_plan.plan_buckets; with tp > 1 each tp rank's part is a message of 1/tp the size
    (resharded), sent once per tp rank."""
    metas = []
    for name, shape in qwen_shapes(config).items():
        rows = math.ceil(shape[0] / senders)
        metas.append(TensorMeta(name, "torch.bfloat16", shape, min(rows, shape[0]), 0))
    sizes = [b.numel * 2 for b in plan_buckets(metas, BUCKET_BYTES, SOLO_BYTES)]
    return [math.ceil(s / tp) for s in sizes for _ in range(tp)]


def hop_latency(n: int, link: Link) -> float:
    """The latency of n - 1 ring hops with nothing to carry but a step's signal (an
    all-gather's steps, each moving 1/n of the message: their bytes are counted apart)."""
    if n <= 1:
        return 0.0
    if link.hops == "flat":
        return (n - 1) * link.t_chunk
    cross = max(0, math.ceil(n / GPUS_PER_NODE) - 1)
    return cross * link.t_chunk + (n - 1 - cross) * link.t_nvl


def ring_fill(n: int, link: Link) -> float:
    """Seconds for a message's first chunk to reach the last of a ring of `n` ranks."""
    if n <= 1:
        return 0.0
    step = link.chunk / link.beta
    if link.hops == "flat":
        return (n - 1) * (link.t_chunk + step)
    cross = max(0, math.ceil(n / GPUS_PER_NODE) - 1)
    return cross * (link.t_chunk + step) + (n - 1 - cross) * (link.t_nvl + step)


def estimate(scheme: str, trainers: int, engines: int, tp: int, link: Link,
             wavefront: bool = True, total: int | None = None,
             bucket_bytes: int = BUCKET_BYTES) -> dict:
    """The sync's time (s) and its terms for one layout, scheme and parameter point."""
    total = model_bytes() if total is None else total
    gpus = engines * tp
    if scheme == "every":
        sizes = sender_messages(trainers, tp=tp)
        ring = 1 + (engines if tp > 1 else gpus)  # resharded: one ring per tp rank
        fills = 1 if wavefront else trainers
        terms = {"bandwidth_s": total / link.beta,  # one sender NIC at a time
                 "fill_s": fills * ring_fill(ring, link),
                 # serialized at each engine GPU: every sender's messages to its tp rank
                 "messages_s": trainers * (len(sizes) // tp) * link.delta,
                 "messages_per_sender": len(sizes), "ring": ring}
        t = terms["bandwidth_s"] + terms["fill_s"] + terms["messages_s"]
    elif scheme == "one":
        buckets = math.ceil(total / bucket_bytes)
        bucket = total / buckets
        ring = 1 + gpus
        # All-gather of one bucket over the trainers' ring: T - 1 steps, each one hop's
        # latency, and (T - 1) / T of the bucket through the ring's slowest links. Across
        # nodes those are the NICs, and NCCL's channels cross each node boundary on different
        # GPUs' NICs (one per GPU), so the node's NICs carry it side by side; inside one node
        # NVLink is faster still (taken as the same bound).
        nics = min(trainers, GPUS_PER_NODE)
        gather = (bucket * (trainers - 1) / trainers / (nics * link.beta)
                  + hop_latency(trainers, link) + link.delta)
        # trainer 0's NIC sends the bucket once, plus its share of the gather's crossings
        # when the trainers span nodes
        share = bucket * (trainers - 1) / trainers / GPUS_PER_NODE if trainers > 8 else 0.0
        cast = (bucket + share) / link.beta + link.delta  # the wavefront follows it down
        fill = ring_fill(ring, link) * (1 if wavefront else buckets)
        terms = {"bucket_bytes": bucket_bytes, "first_gather_s": gather,
                 "gather_per_bucket_s": gather, "broadcast_per_bucket_s": cast,
                 "buckets": buckets, "pipeline_s": buckets * max(gather, cast), "fill_s": fill,
                 "ring": ring, "bandwidth_s": total / link.beta,
                 "messages_s": buckets * link.delta}
        t = gather + terms["pipeline_s"] + fill
    else:
        raise ValueError(f"scheme {scheme!r}: 'every' or 'one'")
    return {"scheme": scheme, "trainers": trainers, "engines": engines, "tp": tp,
            "wavefront": wavefront, **asdict(link), "t_s": t,
            "over_nic_bound": t / (total / link.beta), **terms}


BETAS = (12 * GB, 25 * GB, 45 * GB)
T_CHUNKS = (12e-6, 50e-6)
DELTAS = (10e-6, 30e-6)
CENTRAL = Link(beta=25 * GB, t_chunk=30e-6, delta=20e-6)


def sweep(trainers: int, engines: int, tp: int) -> list[dict]:
    """Every parameter point (beta x t_chunk x delta x hops x wavefront) for both schemes."""
    rows = []
    for beta, tc, d, hops, wave in itertools.product(BETAS, T_CHUNKS, DELTAS, ("nodes", "flat"),
                                                     (True, False)):
        for scheme in ("every", "one"):
            rows.append(estimate(scheme, trainers, engines, tp, Link(beta, tc, d, hops), wave))
    return rows


def fit_gloo(small: dict, large: dict) -> tuple[float, float]:
    """beta (bytes/s) and per-message delta (s) from two raw_single runs: one message of the
    model's bytes on a ring of 2 (trainer 0 -> the engine): t = B / beta + delta."""
    (b1, t1), (b2, t2) = (small["bytes"], small["raw_single_s"]), (large["bytes"],
                                                                  large["raw_single_s"])
    beta = (b2 - b1) / (t2 - t1)
    return beta, t1 - b1 / beta


def gloo_predictions(report: dict, beta: float, delta: float) -> dict:
    """The model's times for bench/weight_sync.py's kinds at one size, against the measured:
    everything through the one engine's loopback at beta; per message delta. raw: B in 64 MiB
    messages (both trainers' halves); raw_p2p: the same messages; sync: the plan's messages of
    both trainers (report['buckets'] per trainer, as the plan of trainer 0 counts them)."""
    b = report["bytes"]
    raw_msgs = report["trainer_ranks"] * math.ceil(b / report["trainer_ranks"] / (64 * MIB))
    sync_msgs = report["trainer_ranks"] * report["buckets"]
    out = {}
    for kind, msgs in (("raw_single", 1), ("raw", raw_msgs), ("raw_p2p", raw_msgs),
                       ("sync", sync_msgs)):
        model = b / beta + msgs * delta
        out[kind] = {"messages": msgs, "model_s": model, "measured_s": report[f"{kind}_s"],
                     "measured_over_model": report[f"{kind}_s"] / model}
    return out


def summary(rows: list[dict], scheme: str) -> dict:
    """Per case (hops 'nodes' or 'flat' x fill once or per sender / bucket): the range of t_s
    and of t / (B / beta) over beta x t_chunk x delta."""
    out = {}
    for hops, wave in itertools.product(("nodes", "flat"), (True, False)):
        pick = [r for r in rows if r["scheme"] == scheme and r["hops"] == hops
                and r["wavefront"] == wave]
        out[f"{hops}_{'wavefront' if wave else 'fill_each'}"] = {
            "min_s": min(r["t_s"] for r in pick), "max_s": max(r["t_s"] for r in pick),
            "over_nic_bound_min": min(r["over_nic_bound"] for r in pick),
            "over_nic_bound_max": max(r["over_nic_bound"] for r in pick)}
    return out


def main() -> None:
    from harness import bench_parser, write_result

    ap = bench_parser("weight_sync_model", __doc__)
    ap.add_argument("--calibrate", nargs="*", default=[],
                    help="bench/weight_sync.py --out reports at two model sizes")
    args = ap.parse_args()
    total = model_bytes()
    assumptions = {
        "model": "Qwen2.5-7B", "params": total // 2, "bytes": total, "dtype": "bfloat16",
        "bucket_bytes": BUCKET_BYTES, "solo_bytes": SOLO_BYTES, "gpus_per_node": GPUS_PER_NODE,
        "nccl_chunk_bytes": CHUNK_BYTES, "t_nvlink_s": T_NVLINK_S,
        "beta_Bps": list(BETAS), "t_chunk_s": list(T_CHUNKS), "delta_s": list(DELTAS),
        "central": asdict(CENTRAL), "target": f"one <= {TARGET} x B / beta",
        "formula": "t = bytes/beta + hops*(t_chunk + chunk/beta) + messages*delta; `one`: "
                   "first gather + buckets*max(gather, broadcast) + broadcast ring fill once",
        "sources": "../shared/scale_review.md section 3 (NVIDIA/nccl#590, #2409, "
                   "verl-project/verl#7167, NCCL tuning model)",
        "what_it_is": "an estimate from public figures; no GPU has run either scheme at size"}
    print(f"Qwen2.5-7B: {total / 2:.3e} parameters, {total / GB:.2f} GB in bf16")
    for k, v in assumptions.items():
        print(f"  assume {k}: {v}")
    layouts = []
    for name, t, e, tp in LAYOUTS:
        rows = sweep(t, e, tp)
        central = {s: estimate(s, t, e, tp, CENTRAL) for s in ("every", "one")}
        entry = {"layout": name, "trainers": t, "engines": e, "tp": tp,
                 "every": summary(rows, "every"), "one": summary(rows, "one"),
                 "central": central, "points": rows}
        layouts.append(entry)
        print(f"\n{name}: T={t} E={e} tp={tp}; B/beta {total / BETAS[-1]:.2f}-"
              f"{total / BETAS[0]:.2f} s")
        for s in ("every", "one"):
            c = central[s]
            print(f"  {s:5s} central {c['t_s']:.3f} s = {c['over_nic_bound']:.2f}x B/beta")
            for case, m in entry[s].items():
                print(f"        {case:16s} {m['min_s']:6.3f}-{m['max_s']:6.3f} s = "
                      f"{m['over_nic_bound_min']:.2f}-{m['over_nic_bound_max']:.2f}x")
        if t > GPUS_PER_NODE * 4:  # the gather's T - 1 steps per bucket: larger buckets
            worst = Link(BETAS[-1], T_CHUNKS[-1], DELTAS[-1])
            big = {mib: estimate("one", t, e, tp, worst, bucket_bytes=mib * MIB)
                   for mib in (64, 128, 256)}
            entry["one_worst_nodes_wavefront_by_bucket_mib"] = big
            print("  one at beta 45 GB/s, t_chunk 50 us, delta 30 us, by bucket size: "
                  + ", ".join(f"{m} MiB {r['over_nic_bound']:.2f}x" for m, r in big.items()))
    result = {"assumptions": assumptions, "layouts": layouts}
    if args.calibrate:
        reports = sorted((json.loads(Path(p).read_text()) for p in args.calibrate),
                         key=lambda r: r["bytes"])
        beta, delta = fit_gloo(reports[0], reports[-1])
        checks = {r["model"]: gloo_predictions(r, beta, delta) for r in reports}
        result["gloo_calibration"] = {"beta_Bps": beta, "delta_s": delta, "fit_on": "raw_single",
                                      "reports": reports, "model_vs_measured": checks}
        print(f"\ngloo loopback fit (raw_single at {len(reports)} sizes): beta {beta / GB:.2f} "
              f"GB/s, delta {delta * 1e6:.0f} us")
        for model, kinds in checks.items():
            for kind, c in kinds.items():
                print(f"  {model:5s} {kind:10s} {c['messages']:4d} msgs: model "
                      f"{c['model_s'] * 1e3:8.2f} ms, measured {c['measured_s'] * 1e3:8.2f} ms "
                      f"({c['measured_over_model']:.2f}x)")
    print(f"\nwrote {write_result('weight_sync_model', result, args)}")


if __name__ == "__main__":
    main()
