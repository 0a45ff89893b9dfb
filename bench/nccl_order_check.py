"""An exhaustive check, on a model, that the NCCL order rule (docs/architecture.md, "NCCL
order") cannot deadlock, with rollout sends co-resident, for every T, E <= 3: small enough to
enumerate every interleaving, in a few seconds.

The model (the worst case NCCL allows): each GPU runs one communication kernel at a time, in
the order its host threads posted them (NCCL kernels of different communicators may block
each other when SMs run short or launches interleave). A kernel of a collective or a
point-to-point op on communicator c completes only when every member GPU of c has that op at
the head of its queue. Host threads post ops (returning at once: on NCCL a wait only orders
streams), wait on the host for an op to complete (a load that needs every bucket in, a
trainer reading the batch it received), or set / wait for a flag (the store: the trainer's
announcement of a version). Every interleaving of the threads is explored (depth-first, each
state once); a state is stuck when some thread is unfinished and no step is possible.

What the code does, as modelled (one sync of version k+1 and the rollouts beside it):
  trainer r   `every`: posts its broadcast on wsync<r> (one op stands for its buckets: they
              are in one order on one communicator); `one`: all-gathers each bucket on the
              trainer group, and trainer 0 broadcasts bucket b on the engines' communicator
              after posting the gather of bucket b + 1 (parallel/weight_sync.py); then its
              next step's FSDP2 collective (trainer group). Trainer 0 announces the version
              (store) before posting its sends. Rollouts: it receives batch k+1 from every
              engine (buffer/dist_channel.py: post, then waits on the host for the payload),
              after its weight sends ('after': the training loop, which publishes and then
              takes the next batch) or before them ('before').
  engine j    main thread: waits for the announcement, then posts the receives sender by
              sender (weight_receiver.py `_post`, transport.ordered; 'inconsistent': engine j
              takes the senders rotated by j, the order the rule forbids), then waits on the
              host for all of them (the load). `one`: the broadcasts of every bucket.
              Rollout threads (one per trainer channel, dist_channel.py `_send_loop`): post
              the send of batch k+1 at any point relative to the main thread ('free'), or
              only once the load is done ('after_load': no send pending beside a receive and
              none posted before it), or before the announcement is read, done before the
              receives are posted ('before_sync': the engine waits its sends out first).
Sync mode (sync.max_staleness 0) is 'before' with batch k sent before the version is
announced; the async modes are the rest.

    python bench/nccl_order_check.py          # every case, T, E <= 3; the JSON to --out
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass

sys.setrecursionlimit(100000)


@dataclass(frozen=True)
class Op:
    """One kernel: `name` unique in the program, on communicator `comm` of GPUs `members`."""

    name: str
    comm: str
    members: frozenset


# A thread's step: ("post", Op, gpu), ("wait", Op) host waits for its completion,
# ("set", flag), ("flag", flag) host waits for a flag.
Step = tuple


@dataclass(frozen=True)
class Outcome:
    stuck: bool
    states: int
    trace: tuple  # the steps that reach a stuck state (empty when none)
    queues: tuple  # the stuck state's GPU queues: (gpu, (op names...))


def explore(threads: dict[str, list[Step]], gpus: list[str], reduce: bool = True) -> Outcome:
    """Every interleaving of `threads` under the one-kernel-at-a-time rule (module
    docstring); the first stuck state found, with the steps that reach it."""
    names = sorted(threads)
    seen: set = set()
    index = {g: i for i, g in enumerate(gpus)}

    def settle(queues: list[tuple], done: frozenset) -> tuple[list[tuple], frozenset]:
        # complete every op at the head of all its members' queues (order-free: completing
        # one never disables another)
        moved = True
        while moved:
            moved = False
            for q in queues:
                if not q:
                    continue
                op = q[0]
                if all(queues[index[g]] and queues[index[g]][0] == op for g in op.members):
                    for g in op.members:
                        queues[index[g]] = queues[index[g]][1:]
                    done = done | {op.name}
                    moved = True
        return queues, done

    def step_of(pcs, queues, done, flags, t):
        thread = threads[t]
        pc = pcs[names.index(t)]
        if pc >= len(thread):
            return None
        s = thread[pc]
        queues = list(queues)
        if s[0] == "post":
            queues[index[s[2]]] = queues[index[s[2]]] + (s[1],)
        elif s[0] == "wait":
            if s[1].name not in done:
                return None
        elif s[0] == "set":
            flags = flags | {s[1]}
        elif s[0] == "flag":
            if s[1] not in flags:
                return None
        queues, done = settle(queues, done)
        new_pcs = list(pcs)
        new_pcs[names.index(t)] += 1
        return tuple(new_pcs), tuple(queues), done, flags

    posters = {g: [t for t in names if any(x[0] == "post" and x[2] == g for x in threads[t])]
               for g in gpus}

    def reduced(pcs, queues, done, flags) -> list[str]:
        """The threads whose steps are explored from a state (a persistent set: exploring
        only these finds every stuck state). A step that commutes with every other and stays
        enabled (a host wait passed, a flag set or waited for, a post to a GPU no other
        thread posts to) alone; else the posts to one GPU all of whose threads stand at a
        post (no other step touches that queue, nor can one of its threads start posting
        meanwhile); else every thread."""
        ready = [t for t in names
                 if step_of(pcs, queues, done, flags, t) is not None]
        if not reduce:
            return ready
        for t in ready:
            s = threads[t][pcs[names.index(t)]]
            if s[0] != "post" or len(posters[s[2]]) == 1:
                return [t]
        for g in gpus:
            mine = [t for t in posters[g] if pcs[names.index(t)] < len(threads[t])]
            if len(mine) > 1 and all(t in ready and threads[t][pcs[names.index(t)]][0] == "post"
                                     and threads[t][pcs[names.index(t)]][2] == g
                                     for t in mine):
                return mine
        return ready

    start = (tuple(0 for _ in names), tuple(() for _ in gpus), frozenset(), frozenset())
    stack = [(start, ())]
    while stack:
        state, trace = stack.pop()
        if state in seen:
            continue
        seen.add(state)
        pcs, queues, done, flags = state
        moves = []
        for t in reduced(pcs, queues, done, flags):
            nxt = step_of(pcs, queues, done, flags, t)
            if nxt is not None:
                moves.append((nxt, trace + (f"{t}: {describe(threads[t][pcs[names.index(t)]])}",)))
        finished = all(pc >= len(threads[t]) for t, pc in zip(names, pcs))
        if not moves and not (finished and not any(queues)):
            return Outcome(True, len(seen), trace,
                           tuple((g, tuple(op.name for op in q)) for g, q in zip(gpus, queues)))
        stack.extend(moves)
    return Outcome(False, len(seen), (), ())


def describe(s: Step) -> str:
    if s[0] == "post":
        return f"post {s[1].name} on {s[2]}"
    if s[0] == "wait":
        return f"host waits for {s[1].name}"
    return f"{s[0]} {s[1]}"


def program(scheme: str, trainers: int, engines: int, order: str = "consistent",
            rollouts: str = "none", trainer_receives: str = "after",
            buckets: int = 2) -> tuple[dict[str, list[Step]], list[str]]:
    """The threads of one sync (and, unless rollouts == 'none', one rollout batch from every
    engine to every trainer) for `scheme` 'every' or 'one' (module docstring)."""
    tr = [f"t{r}" for r in range(trainers)]
    en = [f"e{j}" for j in range(engines)]
    group = frozenset(tr)
    threads: dict[str, list[Step]] = {}
    fsdp = Op("fsdp", "trainers", group)
    pair = {(j, r): Op(f"roll{j}>{r}", f"pair{j},{r}", frozenset({en[j], tr[r]}))
            for j in range(engines) for r in range(trainers)}

    def weights(r: int) -> list[Step]:
        steps: list[Step] = [("set", "announced")] if r == 0 else []
        if scheme == "every":
            steps.append(("post", Op(f"w{r}", f"wsync{r}", frozenset({tr[r], *en})), tr[r]))
        else:
            gathers = [Op(f"ag{b}", "trainers-gather", group) for b in range(buckets)]
            casts = [Op(f"bc{b}", "engines", frozenset({tr[0], *en})) for b in range(buckets)]
            steps.append(("post", gathers[0], tr[r]))
            for b in range(buckets):  # the gather of b + 1, then the broadcast of b
                if b + 1 < buckets:
                    steps.append(("post", gathers[b + 1], tr[r]))
                if r == 0:
                    steps.append(("post", casts[b], tr[r]))
        return steps

    def receive_rollouts(r: int) -> list[Step]:
        steps: list[Step] = []
        for j in range(engines):
            steps += [("post", pair[j, r], tr[r]), ("wait", pair[j, r])]
        return steps

    for r in range(trainers):
        steps: list[Step] = []
        if rollouts != "none" and trainer_receives == "before":
            steps += receive_rollouts(r)
        steps += weights(r)
        if rollouts != "none" and trainer_receives == "after":
            steps += receive_rollouts(r)
        steps.append(("post", fsdp, tr[r]))
        threads[tr[r]] = steps
    for j in range(engines):
        if scheme == "every":
            senders = list(range(trainers))
            if order == "inconsistent":
                senders = senders[j % trainers:] + senders[:j % trainers]
            ops = [Op(f"w{s}", f"wsync{s}", frozenset({tr[s], *en})) for s in senders]
        else:
            ops = [Op(f"bc{b}", "engines", frozenset({tr[0], *en})) for b in range(buckets)]
            if order == "inconsistent":
                raise ValueError("scheme 'one' has one communicator: no order to get wrong")
        main: list[Step] = []
        if rollouts == "before_sync":
            main += [("flag", f"sent{j},{r}") for r in range(trainers)]
        main += [("flag", "announced")] + [("post", op, en[j]) for op in ops]
        main += [("wait", op) for op in ops]
        if rollouts == "after_load":
            main.append(("set", f"loaded{j}"))
        threads[en[j]] = main
        if rollouts == "none":
            continue
        for r in range(trainers):
            send: list[Step] = []
            if rollouts == "after_load":
                send.append(("flag", f"loaded{j}"))
            send.append(("post", pair[j, r], en[j]))
            if rollouts == "before_sync":
                send += [("wait", pair[j, r]), ("set", f"sent{j},{r}")]
            threads[f"{en[j]}-roll{r}"] = send
    return threads, tr + en


CASES = [  # (scheme, order, rollouts, trainer_receives)
    ("every", "consistent", "none", "after"),
    ("one", "consistent", "none", "after"),
    ("every", "inconsistent", "none", "after"),
    ("every", "consistent", "free", "after"),
    ("every", "consistent", "free", "before"),
    ("one", "consistent", "free", "after"),
    ("every", "consistent", "after_load", "after"),
    ("every", "consistent", "after_load", "before"),
    ("one", "consistent", "after_load", "after"),
    ("every", "consistent", "before_sync", "after"),
    ("every", "consistent", "before_sync", "before"),
    ("one", "consistent", "before_sync", "before"),
]


def check(scheme: str, order: str, rollouts: str, trainer_receives: str,
          sizes=range(1, 4), reduce: bool = True) -> dict:
    """Every T, E in `sizes`: stuck anywhere? The first stuck layout's trace."""
    states, first = 0, None
    for t, e in itertools.product(sizes, sizes):
        if order == "inconsistent" and (t < 2 or e < 2):
            continue  # one sender or one engine: no two orders to disagree
        out = explore(*program(scheme, t, e, order, rollouts, trainer_receives), reduce=reduce)
        states += out.states
        if out.stuck and first is None:
            first = {"trainers": t, "engines": e, "trace": list(out.trace),
                     "queues": {g: list(q) for g, q in out.queues if q}}
    return {"scheme": scheme, "order": order, "rollouts": rollouts,
            "trainer_receives": trainer_receives, "stuck": first is not None,
            "states": states, "first_stuck": first}


def main() -> None:
    import time
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from harness import bench_parser, write_result

    ap = bench_parser("nccl_order_check", __doc__)
    args = ap.parse_args()
    start = time.perf_counter()
    results = [check(*case) for case in CASES]
    for r in results:
        print(f"{r['scheme']:5s} {r['order']:12s} rollouts {r['rollouts']:11s} trainer receives "
              f"{r['trainer_receives']:6s}: {'STUCK' if r['stuck'] else 'never stuck'} "
              f"({r['states']} states)")
        if r["stuck"]:
            f = r["first_stuck"]
            print(f"      T={f['trainers']} E={f['engines']}, stuck with queues {f['queues']}")
    took = time.perf_counter() - start
    print(f"{took:.1f} s")
    print(f"wrote {write_result('nccl_order_check', {'cases': results, 'seconds': took}, args)}")


if __name__ == "__main__":
    main()
