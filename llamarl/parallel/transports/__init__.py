"""Weight-sync transports: how the buckets of a sync get from the trainer ranks to the engines.

A transport is one module with two classes, `Sender` (on each trainer rank) and `Receiver` (in
each engine's worker), both subclasses of the ones in `base.py` and both built from a
`TransportSpec`. The plan (parallel/weight_plan.py), the packing and loading
(weight_sender.py, weight_receiver.py) and the announcements stay the same whatever moves the
bytes. The recipe key `sync.transport` names one: a name registered below, or the import path
of a module of your own (`my_pkg.my_transport`).
"""

from __future__ import annotations

import importlib
from types import ModuleType

TRANSPORTS = {
    "torch": "llamarl.parallel.transports.torch_dist",  # gloo (CPU) / NCCL (GPU) groups
    "filesystem": "llamarl.parallel.transports.filesystem",  # files in a shared directory
}


def transport_module(name: str) -> ModuleType:
    """The module of transport `name` (registered, or an import path); ValueError if it is
    neither or lacks Sender/Receiver."""
    path = TRANSPORTS.get(name, name)
    try:
        module = importlib.import_module(path)
    except ImportError as e:
        raise ValueError(f"sync.transport {name!r}: no such transport ({e}); use one of "
                         f"{', '.join(TRANSPORTS)} or the import path of a module with "
                         "Sender and Receiver classes") from e
    if not all(hasattr(module, cls) for cls in ("Sender", "Receiver")):
        raise ValueError(f"sync.transport {name!r}: module {path} has no Sender and Receiver "
                         "classes (see llamarl/parallel/transports/base.py)")
    return module
