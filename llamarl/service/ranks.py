"""The service over several trainer ranks (`torchrun --nproc-per-node N -m llamarl.service`):
rank 0 serves HTTP and sends every tenant operation to the other ranks, which follow it
(`follow`), over the world's gloo group (docs/service.md).

Each rank holds the frozen base and every tenant's adapter and AdamW state, replicated: an
adapter is small (a rank-32 one on SmolLM2 is 10 MB), so replicas cost little, and a step
needs no gather of the adapter. A forward_backward is data-parallel: datum i runs on rank
i mod N, each rank's losses and gradients are per-token sums over its own data, and before
each optim_step the gradients are summed over the ranks (all_reduce SUM): the sum over all
the data, Tinker's definition, whatever N. Every rank then takes the same AdamW step on the
same gradient, so the replicas stay equal (`replica_checksums` checks it in the tests).

Ordering: one operation at a time (`lock`): its command object is broadcast from rank 0, then
every rank runs it, with the collectives it needs, in the same order. A request is checked on
rank 0 before it is sent (a bad one never reaches the followers). A follower that fails an
operation sends its error back in the gather; rank 0 raises it as the server's error.
"""

from __future__ import annotations

import sys
import threading

import torch
import torch.distributed as dist

from llamarl.service.tenants import AdamStep, ForwardResult, LoraSpec, LoraTenants


class ReplicatedTenants:
    """LoraTenants on rank 0 of the world, every operation mirrored on the other ranks (which
    run `follow`). The surface TinkerService uses: model, max_tenants, get, check, create,
    remove, forward, optim_step, state, load_state, adapter_state, peft_config."""

    def __init__(self, local: LoraTenants):
        assert dist.is_initialized() and dist.get_rank() == 0
        self.local = local
        self.model, self.max_tenants = local.model, local.max_tenants
        self.world = dist.get_world_size()
        self.lock = threading.RLock()

    # local reads (the replicas are equal)
    def get(self, name: str):
        return self.local.get(name)

    def check(self, data, loss_fn, config) -> None:
        self.local.check(data, loss_fn, config)

    def state(self, name: str, with_optimizer: bool) -> dict:
        return self.local.state(name, with_optimizer)

    def adapter_state(self, name: str) -> dict:
        return self.local.adapter_state(name)

    def peft_config(self, name: str) -> dict:
        return self.local.peft_config(name)

    # mirrored operations
    def _run(self, command: tuple, combine=lambda results: results[0]):
        """Send `command`, run it on every rank, gather the outcomes; -> combine(results), or
        the exception of the first rank that failed (rank 0's own first)."""
        with self.lock:
            dist.broadcast_object_list([command], src=0)
            outcomes = [None] * self.world
            dist.gather_object(run_command(self.local, command), outcomes, dst=0)
        for _, error in outcomes:
            if error is not None:
                kind, line = error
                raise {"ValueError": ValueError, "KeyError": KeyError}.get(
                    kind, RuntimeError)(line)
        return combine([result for result, _ in outcomes])

    def create(self, name: str, spec: LoraSpec) -> None:
        self.local.check_create(name)
        self._run(("create", name, spec))

    def remove(self, name: str) -> None:
        self.local.get(name)
        self._run(("remove", name))

    def load_state(self, name: str, state: dict, with_optimizer: bool) -> None:
        self._run(("load_state", name, state, with_optimizer))

    def forward(self, name: str, data, loss_fn=None, config=None,
                backward: bool = False) -> ForwardResult:
        self.local.check(data, loss_fn, config)
        self.local.get(name)
        return self._run(("forward", name, data, loss_fn, config, backward), _in_order)

    def optim_step(self, name: str, step: AdamStep) -> dict[str, float]:
        self.local.get(name)
        return self._run(("optim_step", name, step))

    def replica_checksums(self) -> list[float]:
        """Each rank's sum over every tenant's adapter and AdamW moments (equal replicas:
        equal sums)."""
        return self._run(("checksum",), list)

    def stop(self) -> None:
        """End the followers' loops (the server is stopping)."""
        with self.lock:
            try:
                dist.broadcast_object_list([("stop",)], src=0)
            except RuntimeError as e:  # (a follower gone already: nothing left to stop)
                print(f"llamarl service: stopping the other trainer ranks: {e}".split("\n")[0],
                      file=sys.stderr, flush=True)


def run_command(tenants: LoraTenants, command: tuple):
    """This rank's part of `command`, its collectives in the same order on every rank; ->
    (its result, None) or (None, (the exception's type name, one line))."""
    op, args = command[0], command[1:]
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        if op == "create":
            tenants.create(*args)
            return None, None
        if op == "remove":
            tenants.remove(*args)
            return None, None
        if op == "load_state":
            tenants.load_state(*args)
            return None, None
        if op == "forward":
            name, data, loss_fn, config, backward = args
            mine = data[rank::world]  # datum i on rank i mod N
            if not mine:  # (fewer data than ranks: this one has none, and joins the gather)
                return ForwardResult([], None if loss_fn is None else 0.0), None
            return tenants.forward(name, mine, loss_fn, config, backward), None
        if op == "optim_step":
            name, step = args
            params = tenants.get(name).params
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                              .reshape(-1) for p in params])
            dist.all_reduce(flat)  # the gradient of the sum over every rank's data
            for p, g in zip(params, flat.split([p.numel() for p in params])):
                p.grad = g.view_as(p).clone()
            return tenants.optim_step(name, step), None
        if op == "checksum":
            total = 0.0
            for name in sorted(tenants.tenants):
                tenant = tenants.get(name)
                total += sum(float(p.detach().double().sum()) for p in tenant.params)
                total += sum(float(v.double().sum()) for s in tenant.optimizer.state.values()
                             for v in s.values() if torch.is_tensor(v))
            return total, None
        raise AssertionError(f"unknown service command {op!r}")
    except Exception as e:  # noqa: BLE001 - sent to rank 0, which answers the client
        line = str(e).strip("'\"")
        return None, (type(e).__name__, line if rank == 0 else f"on trainer rank {rank}: {line}")


def _in_order(results: list[ForwardResult]) -> ForwardResult:
    """The ranks' forward results as one, the logprobs back in the data's order (datum i ran
    on rank i mod N), the loss summed."""
    world, total = len(results), sum(len(r.logprobs) for r in results)
    logprobs = [results[i % world].logprobs[i // world] for i in range(total)]
    loss = None if results[0].loss is None else sum(r.loss for r in results)
    return ForwardResult(logprobs, loss)


def follow(tenants: LoraTenants) -> None:
    """A rank > 0: run rank 0's commands until it sends stop (or the world breaks: the
    collective's error ends this rank)."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0][0] == "stop":
            return
        dist.gather_object(run_command(tenants, box[0]), None, dst=0)
