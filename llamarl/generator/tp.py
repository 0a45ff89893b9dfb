"""Tensor-parallel engines: one vLLM engine driven SPMD by its tp ranks, led by tp rank 0.

With `generator.tp > 1` every tp rank of an engine builds the same vLLM engine under vLLM's
`external_launcher` backend (engine.py, `EngineWorld`): each rank runs its own scheduler and
holds 1/tp of every layer, and the ranks meet in the layers' collectives. The schedulers only
agree if every rank makes the same engine calls, with the same arguments, in the same order.

So only the leader (tp rank 0) runs the generator loop (data, rewards, tools, evaluation,
rollouts, the decisions when to load weights). Every call it makes that drives vLLM (the
methods of `Engine` marked `@spmd`: generate, submit, step, pause, resume, weight loads, ...) is
first sent to the other tp ranks as a command (the method's name and arguments, pickled), and
they make the same call on their own engine (`follow_leader`). Their results are identical to
the leader's (the same logits, all-gathered, and the same seeded sampler) and are discarded.
Commands are never nested: a command's own inner calls (generate pausing requests in flight)
run on every rank as part of it.

Weights reach every tp rank directly: each rank is a member of the trainers' weight groups and
receives and loads its own copy (vLLM's load_weights keeps the rank's shard).

The commands travel on a gloo group of the engine's tp ranks (its ranks share a node, the
layout checks), on CPU tensors whatever the device. A follower may wait for its next command
as long as the leader waits for the trainer (a long step, a checkpoint), so the group's timeout
is long: a dead leader ends the followers through the watchdog, not through this timeout (when
the job survives losing the engine, they leave it with exit 0: runtime/watchdog.py).
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from llamarl.parallel.groups import GroupSpec, make_group

# A follower waits for the leader's next command at most this long (see the module docstring).
COMMAND_TIMEOUT_S = 7 * 24 * 3600.0
_STOP = "__stop__"


class EngineCommands:
    """The command stream of one tp > 1 engine (group rank = tp rank; 0 sends, others receive).

    A command is two gloo messages from the leader to each follower: its pickled size (int64)
    and the pickle of (method name, args, kwargs)."""

    def __init__(self, spec: GroupSpec, store: dist.Store | None = None):
        spec = replace(spec, backend="gloo", timeout_s=COMMAND_TIMEOUT_S)
        self.rank, self.size = spec.rank, spec.size
        self.group = make_group(spec, store)
        self.sent = 0  # commands sent (leader) or received (follower)

    def send(self, name: str, args: tuple = (), kwargs: dict | None = None) -> None:
        assert self.rank == 0, "only the engine's leader sends commands"
        payload = pickle.dumps((name, args, kwargs or {}), protocol=pickle.HIGHEST_PROTOCOL)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        works = [self.group.send([t], dst, 0) for dst in range(1, self.size) for t in (size, data)]
        for work in works:
            work.wait()
        self.sent += 1

    def receive(self) -> tuple[str, tuple, dict]:
        size = torch.empty(1, dtype=torch.int64)
        self.group.recv([size], 0, 0).wait()
        data = torch.empty(int(size), dtype=torch.uint8)
        self.group.recv([data], 0, 0).wait()
        self.sent += 1
        return pickle.loads(data.numpy().tobytes())

    def stop(self) -> None:
        """Leader: the engine is done; the followers return from follow_leader."""
        self.send(_STOP)


def spmd(method: Callable) -> Callable:
    """Mark an `Engine` method that drives vLLM: on the leader of a tp > 1 engine (its
    `commands` set), the call is sent to the other tp ranks before it runs here. Calls made
    inside such a call are part of it and are not sent again."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self.commands is None or self._in_command:
            return method(self, *args, **kwargs)
        self.commands.send(method.__name__, args, kwargs)
        self._in_command = True
        try:
            return method(self, *args, **kwargs)
        finally:
            self._in_command = False

    call.spmd = True
    return call


def follow_leader(engine: Any, commands: EngineCommands) -> int:
    """A follower tp rank: make every call its leader makes, until the leader stops. Returns
    the number of commands followed."""
    assert commands.rank != 0 and engine.commands is None
    while True:
        name, args, kwargs = commands.receive()
        if name == _STOP:
            return commands.sent - 1
        method = getattr(type(engine), name, None)
        assert getattr(method, "spmd", False), f"{name!r} is not an engine command"
        method(engine, *args, **kwargs)
