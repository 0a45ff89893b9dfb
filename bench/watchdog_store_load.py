"""The watchdog's load on the job store at N ranks: one TCPStore, N watchdogs running their real
loop (llamarl/runtime/watchdog.py), spread over a few client processes as threads.

For each N it reports the store calls and the keys a second the watchdogs make (counted at the
clients, every call of the store API; a call of several keys, `multi_get` or `check`, counts
each key: the store does the work of each), each watchdog's sweep period (seconds between its
own heartbeats, median over the ranks; HEARTBEAT_S when the sweep itself costs nothing), and
the peers they found dead although every one of them was running: the false dead-peer reports,
which must be none. The layout is the 1024-GPU one of docs/scaling.md scaled down (a quarter
trainer ranks, the rest engines of tp 1), 8 ranks a node (`--ranks-per-node`; 1: every rank a host).

On the 2-core machine the client side is emulated: N ranks' Python loops share two cores, so
the ranks' own CPU work is N times what one rank does on a cluster. Hosts are emulated: each
watchdog names the host of its rank (`Watchdog.host`: `bench-node-<rank // ranks per node>`),
so it watches the pids of its node's other ranks through /proc (the client processes', which
run) and nobody else's. The store's load (keys a second) is what the design sets.

    python bench/watchdog_store_load.py --ranks 64 256 1024 --seconds 40
    python bench/watchdog_store_load.py --ranks 1024 --ranks-per-node 1
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import bench_parser, write_result  # noqa: E402

MANY_KEYS = {"multi_get", "multi_set", "check", "wait"}  # store calls whose first argument
# is a list of keys


class CountingStore:
    """A store client that counts its calls and the keys they read or write (every method of
    the store API): counter[0] calls, counter[1] keys."""

    def __init__(self, store, counter):
        self._store, self._counter = store, counter

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def call(*args, **kwargs):
            self._counter[0] += 1
            self._counter[1] += len(args[0]) if name in MANY_KEYS and args else 1
            return method(*args, **kwargs)

        return call


def client(port: int, ranks: list[int], world: int, per_node: int, seconds: float,
           dead_after_s: float, out: mp.Queue, started, measured) -> None:
    """One client process: a watchdog for each of `ranks`, each with its own connection."""
    import torch.distributed as dist

    from llamarl.runtime.layout import compute_layout
    from llamarl.runtime.watchdog import Watchdog

    layout = compute_layout(world, per_node, world // 4, world - world // 4, 1)
    faults: list[str] = []
    counters = {r: [0, 0] for r in ranks}

    class BenchWatchdog(Watchdog):
        """The real loop; a fault is recorded instead of ending the process (here every
        peer runs, so any fault is a false report)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.host = f"bench-node-{layout.node_of(self.rank)}"  # (an emulated host)

        def _fault(self, rank, cause, store):
            faults.append(f"rank {self.rank}: {cause}")
            self.excused.add(rank)  # (reported once)

        def _die(self, cause, store, code=1, prefix="", holding=False):
            faults.append(f"rank {self.rank}: dies: {cause}")
            self._stop.set()

    def connect(r):
        raw = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30),
                            wait_for_workers=False)
        return CountingStore(dist.PrefixStore("job", raw), counters[r])

    try:
        dogs = []
        for r in ranks:
            dog = BenchWatchdog(lambda r=r: connect(r), r, layout, dead_after_s)
            dog.start()
            dogs.append(dog)
        started.wait()  # every client process has started its watchdogs
        time.sleep(2 * 1.0)  # (two sweeps: every counter created, every process seen)
        reader = connect(ranks[0])
        beats0 = {r: int(reader.add(f"hb/{r}", 0)) for r in ranks}
        calls0, keys0 = (sum(c[k] for c in counters.values()) for k in (0, 1))
        t0 = time.monotonic()
        time.sleep(seconds)
        elapsed = time.monotonic() - t0
        calls, keys = (sum(c[k] for c in counters.values()) - n0
                       for k, n0 in ((0, calls0), (1, keys0)))
        beats = {r: int(reader.add(f"hb/{r}", 0)) - beats0[r] for r in ranks}
        reported = list(faults)  # (before any client process ends: its peers would see it gone)
        periods = [elapsed / b if b else float("inf") for b in beats.values()]
        out.put({"calls": calls, "keys": keys,  # (the reader's calls fall outside)
                 "elapsed": elapsed, "periods": periods,
                 "faults": reported})
        measured.wait()  # every process has measured: ending now reports nobody
    except Exception as e:  # noqa: BLE001 - e.g. the store stopped accepting connections
        out.put({"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
        started.abort()
        measured.abort()
    out.close()
    out.join_thread()
    os._exit(0)  # (the watchdog threads are inside store calls: no interpreter shutdown)


def run(world: int, per_node: int, processes: int, seconds: float, dead_after_s: float) -> dict:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30),
                           wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    started, measured = ctx.Barrier(processes), ctx.Barrier(processes)
    shares = [list(range(k, world, processes)) for k in range(processes)]
    procs = [ctx.Process(target=client, args=(server.port, share, world, per_node, seconds,
                                              dead_after_s, out, started, measured))
             for share in shares]
    for p in procs:
        p.start()
    parts = [out.get(timeout=seconds * 3 + 600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    errors = [part["error"] for part in parts if "error" in part]
    if errors:  # the store did not keep up: the failure is the measurement
        return {"ranks": world, "error": errors[0], "failed_clients": len(errors)}
    periods = [x for part in parts for x in part["periods"]]
    faults = [f for part in parts for f in part["faults"]]
    elapsed = statistics.median(part["elapsed"] for part in parts)
    calls_per_s = sum(part["calls"] / part["elapsed"] for part in parts)
    keys_per_s = sum(part["keys"] / part["elapsed"] for part in parts)
    return {"ranks": world, "ranks_per_node": per_node,
            "store_calls_per_s": round(calls_per_s, 1),
            "store_calls_per_rank_s": round(calls_per_s / world, 2),
            "store_keys_per_s": round(keys_per_s, 1),
            "store_keys_per_rank_s": round(keys_per_s / world, 2),
            "sweep_period_s_median": round(statistics.median(periods), 3),
            "sweep_period_s_max": round(max(periods), 3),
            "false_dead_reports": len(faults), "first_reports": faults[:5],
            "measured_s": round(elapsed, 1)}


def main() -> None:
    ap = bench_parser("watchdog_store_load", __doc__)
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--ranks-per-node", type=int, default=8,
                    help="emulated hosts: 8 ranks each (1: every rank its own host)")
    ap.add_argument("--processes", type=int, default=4, help="client processes")
    ap.add_argument("--seconds", type=float, default=40.0, help="measured, after a start-up")
    ap.add_argument("--dead-after-s", type=float, default=30.0, help="sync.dead_peer_s")
    args = ap.parse_args()
    rows = []
    for world in args.ranks:
        row = run(world, args.ranks_per_node, args.processes, args.seconds, args.dead_after_s)
        print(row, flush=True)
        rows.append(row)
    write_result("watchdog_store_load", {"rows": rows}, args)


if __name__ == "__main__":
    threading.excepthook = lambda a: None  # (a client thread ending with the bench)
    main()
