"""A trainer that sends the tiny model twice on a gloo weight group and quits at once, as a
trainer rank does after its last sync: group rank 0 of `wsync0` on the store at
127.0.0.1:$PORT (tests/test_weight_transport.py is the engine, group rank 1). Each send waits
for the key `go/<i>` (the engine's receives are posted by then)."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from llamarl.parallel.transports.torch_dist import Sender
from llamarl.parallel.weight_sender import WeightSender
from llamarl.tiny.model import build_model

if __name__ == "__main__":
    store = dist.TCPStore("127.0.0.1", int(os.environ["PORT"]), None, False,
                          timeout=timedelta(seconds=60))
    group = dist.ProcessGroupGloo(dist.PrefixStore("wsync0", store), 0, 2,
                                  timedelta(seconds=60))
    model, _ = build_model(0)
    sender = WeightSender(model, 0, 64, Sender.over(group), torch.device("cpu"))
    for i in range(2):
        store.wait([f"go/{i}"])
        sender.send(model)
    os._exit(0)  # no goodbye: the connection just closes
