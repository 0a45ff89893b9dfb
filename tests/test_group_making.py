"""parallel/groups.py: groups are made connected (NCCL's communicator at construction, not at the
first operation), a group whose peer is gone can be given up, and gloo can be made lazy like
NCCL for the CPU tests; runtime/setup.py: an engine lost during start-up stops the job."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from llamarl.parallel.groups import LAZY_GROUPS_ENV, GroupSpec, LazyGlooGroup, make_group
from llamarl.runtime.layout import compute_layout
from llamarl.runtime.roster import started_key
from llamarl.runtime.setup import engine_loss_excuse, free_port


@pytest.fixture
def store_port():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    yield port
    del server


def _spec(port: int, rank: int, name: str = "g") -> GroupSpec:
    return GroupSpec("127.0.0.1", port, f"test/{name}", rank, 2, "gloo", 60.0)


def test_a_group_whose_peer_never_comes_is_given_up(store_port):
    """Member 1 never arrives: make_group returns None as soon as give_up() says so, not
    after the group's 60 s timeout."""
    gone_at = time.monotonic() + 0.5
    t0 = time.monotonic()
    assert make_group(_spec(store_port, 0), give_up=lambda: time.monotonic() > gone_at) is None
    assert time.monotonic() - t0 < 5


def test_a_group_whose_peers_all_come_is_made_with_give_up(store_port):
    got: list = [None, None]

    def member(rank: int) -> None:
        got[rank] = make_group(_spec(store_port, rank), give_up=lambda: False)

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(g is not None and g.size() == 2 for g in got)
    x = torch.arange(4.0)
    y = torch.zeros(4)
    works = [got[0].send([x], 1, 7), got[1].recv([y], 0, 7)]
    for w in works:
        w.wait()
    assert torch.equal(x, y)


def test_a_make_that_fails_as_its_peer_dies_is_given_up_not_raised(store_port, monkeypatch):
    """A peer killed halfway through the rendezvous makes gloo's connect fail (connection
    refused) before the watchdogs have declared it lost: make_group keeps asking give_up() and
    returns None once they have; a failure whose peer is never declared gone is raised after
    GIVE_UP_GRACE_S. (The real kill: tests/test_gpu_path_on_cpu.py, the killed replacement.)"""
    import llamarl.parallel.groups as groups

    def refused(spec, store):
        raise RuntimeError("Gloo connectFullMesh failed: Connection refused")

    monkeypatch.setattr(groups, "_connected", refused)
    declared_at = time.monotonic() + 0.5
    assert make_group(_spec(store_port, 0), give_up=lambda: time.monotonic() > declared_at) is None
    monkeypatch.setattr(groups, "GIVE_UP_GRACE_S", 0.3)
    with pytest.raises(RuntimeError, match="Connection refused"):
        make_group(_spec(store_port, 0), give_up=lambda: False)


def test_lazy_gloo_meets_at_its_first_operation(store_port, monkeypatch):
    """LAZY_GROUPS_ENV: a lazy group knows its rank and size without its peer; made through
    make_group it is connected before it is returned (the peer must be there: given up here),
    as NCCL's communicator is."""
    store = dist.TCPStore("127.0.0.1", store_port, None, False)
    lazy = LazyGlooGroup(dist.PrefixStore("lazy", store), 0, 2,
                         __import__("datetime").timedelta(seconds=60))
    assert (lazy.name(), lazy.rank(), lazy.size()) == ("gloo", 0, 2)  # no peer needed
    monkeypatch.setenv(LAZY_GROUPS_ENV, "1")
    gone_at = time.monotonic() + 0.5
    assert make_group(_spec(store_port, 0, "lazy2"),
                      give_up=lambda: time.monotonic() > gone_at) is None


def test_an_engine_lost_in_start_up_stops_the_job_later_ones_are_excused(capsys):
    """1 trainer + 2 engines (ranks 1, 2), engine losses survivable: engine 1 (rank 2) lost
    before it built its groups with the trainers is not excused (the job stops, one line);
    once it has (`started/2`), it is, and engine 0 makes its slot."""
    layout = compute_layout(3, 3, 1, 2, 1)
    excuse = engine_loss_excuse(layout, survives=True)
    store = dist.HashStore()
    assert excuse(store, 2, "rank 2 (generator 1) died") is False
    line = capsys.readouterr().err
    assert "generator 1 was lost during start-up" in line and "launch it again" in line
    store.set(started_key(2), "1")
    assert excuse(store, 2, "rank 2 (generator 1) died") is True
    assert "the job goes on with 1 of 2 engines" in capsys.readouterr().err
