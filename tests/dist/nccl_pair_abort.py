"""torchrun --nproc-per-node 3 on 3 GPUs: rank 0 is a trainer's sender with a pair group to
each of two engines (ranks 1 and 2; sync.weight_groups pairs, NCCL), sending point to point as
torch_dist.Sender does. After one good sync engine 2 dies (os._exit). The sender's next send
to it holds; aborting that pair group (what parallel/weight_members.py does once the watchdog
excuses the engine) must end it, and the pair with engine 1 must go on working. Writes
$OUT.0 (JSON)."""

import json
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from llamarl.parallel.groups import GroupSpec, make_group
from llamarl.runtime.job_store import connect_store

if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.PrefixStore("t", connect_store(host, port, 60))

    def pair(e: int, me: int):
        return make_group(GroupSpec(host, port, f"t/pair{e}", me, 2, "nccl", 60))

    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    if rank == 0:
        groups = [pair(1, 0), pair(2, 0)]
        for g in groups:  # a good sync to both
            g.send([x], 1, 0).wait()
        torch.cuda.synchronize()
        store.wait(["dead/2"], timedelta(seconds=60))
        time.sleep(1)
        works = [g.send([x + 1], 1, 0) for g in groups]
        works[0].wait()
        torch.cuda.synchronize()  # engine 1 got it
        aborted = threading.Event()

        def abort_later():  # the watchdog's thread, a while later
            time.sleep(2)
            groups[1].abort()
            aborted.set()

        threading.Thread(target=abort_later, daemon=True).start()
        t0 = time.monotonic()
        try:
            works[1].wait()
            torch.cuda.synchronize()
            err = None
        except Exception as e:  # noqa: BLE001 - what the abort makes of the pending send
            err = f"{type(e).__name__}: {e}"
        released_s = time.monotonic() - t0
        groups[0].send([x + 2], 1, 0).wait()  # the live pair goes on
        torch.cuda.synchronize()
        with open(os.environ["OUT"] + ".0", "w") as f:
            json.dump({"released_s": released_s, "aborted": aborted.is_set(), "error": err},
                      f)
        store.set("done/0", "1")
    else:
        g = pair(rank, 1)
        y = torch.empty_like(x)
        g.recv([y], 0, 0).wait()
        torch.cuda.synchronize()
        if rank == 2:
            store.set("dead/2", "1")
            os._exit(0)
        g.recv([y], 0, 0).wait()
        g.recv([y], 0, 0).wait()
        torch.cuda.synchronize()
        assert torch.equal(y, x + 2)
        store.wait(["done/0"], timedelta(seconds=120))
    os._exit(0)
