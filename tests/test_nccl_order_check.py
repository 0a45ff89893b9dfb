"""bench/nccl_order_check.py: the exhaustive deadlock check of the NCCL order rule on its
worst-case model (one kernel at a time per GPU, in posting order), every T, E <= 3 and every
interleaving: the weight sync's orders never stick; an engine taking the senders in an order
of its own does (the check can fail); and what it says of rollout sends beside a sync."""

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("nccl_order_check",
                                                  BENCH / "nccl_order_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["nccl_order_check"] = module  # its dataclasses look themselves up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("nccl_order_check", None)


def test_a_cycle_of_two_communicators_is_stuck_and_one_order_is_not(check):
    """By hand: GPUs a and b, communicators x and y over both. a posts x then y, b posts y
    then x: each waits at the head of its queue for the other (stuck); both x then y: not."""
    x = check.Op("x", "x", frozenset({"a", "b"}))
    y = check.Op("y", "y", frozenset({"a", "b"}))
    crossed = {"a": [("post", x, "a"), ("post", y, "a")],
               "b": [("post", y, "b"), ("post", x, "b")]}
    out = check.explore(crossed, ["a", "b"])
    assert out.stuck and dict(out.queues) == {"a": ("x", "y"), "b": ("y", "x")}
    same = {"a": [("post", x, "a"), ("post", y, "a")], "b": [("post", x, "b"), ("post", y, "b")]}
    assert not check.explore(same, ["a", "b"]).stuck


@pytest.mark.parametrize("scheme", ["every", "one"])
def test_the_weight_syncs_order_never_sticks(check, scheme):
    assert not check.check(scheme, "consistent", "none", "after")["stuck"]


def test_engines_receiving_in_orders_of_their_own_stick(check):
    r = check.check("every", "inconsistent", "none", "after")
    assert r["stuck"] and (r["first_stuck"]["trainers"], r["first_stuck"]["engines"]) == (2, 2)


@pytest.mark.parametrize("scheme,rollouts,receives,stuck", [
    # a rollout thread posting at any time, beside a sync's receives: stuck on the worst case
    # (the co-residency docs/architecture.md names), whichever side the trainer receives on
    ("every", "free", "after", True), ("every", "free", "before", True),
    ("one", "free", "after", True),
    # sends posted only once the engine loaded the sync, trainers taking the batch after
    # publishing (the async loop's order): never stuck
    ("every", "after_load", "after", False), ("one", "after_load", "after", False),
    # sends waited out before the receives are posted, the trainer taking the batch before
    # it publishes (the synchronous loop): never stuck; after it publishes: stuck
    ("every", "before_sync", "before", False), ("one", "before_sync", "before", False),
    ("every", "before_sync", "after", True),
])
def test_rollout_sends_beside_a_sync(check, scheme, rollouts, receives, stuck):
    assert check.check(scheme, "consistent", rollouts, receives)["stuck"] is stuck


def test_the_reduction_finds_what_the_full_search_finds(check):
    """Exploring fewer interleavings (explore's persistent sets) must find the same stuck
    states: against every interleaving at T, E <= 2."""
    for case in check.CASES:
        for t, e in itertools.product((1, 2), (1, 2)):
            if case[1] == "inconsistent" and (t < 2 or e < 2):
                continue
            prog = check.program(case[0], t, e, *case[1:])
            assert (check.explore(*prog).stuck
                    == check.explore(*prog, reduce=False).stuck), (case, t, e)
