import pytest

from llamarl.runtime.dist_env import _first_host, from_environ
from llamarl.runtime.layout import compute_layout


def test_default_layout_roles():
    lay = compute_layout(3, 3, trainer_ranks=2, engines=1, tp=1)
    assert [lay.role_of(r).name for r in range(3)] == ["trainer 0", "trainer 1", "generator 0"]
    assert lay.role_of(2).is_engine_leader
    assert lay.generator_global_ranks == [2]


def test_tp_engines_layout():
    lay = compute_layout(8, 8, trainer_ranks=4, engines=2, tp=2)
    roles = [lay.role_of(r) for r in range(8)]
    assert [(r.role, r.index, r.tp_rank) for r in roles[4:]] == [
        ("generator", 0, 0), ("generator", 0, 1), ("generator", 1, 0), ("generator", 1, 1)]
    assert lay.engine_global_ranks(1) == [6, 7]
    assert not roles[5].is_engine_leader


def test_world_size_mismatch_names_numbers_and_fix():
    with pytest.raises(ValueError) as e:
        compute_layout(2, 2, trainer_ranks=2, engines=1, tp=1)
    msg = str(e.value)
    assert "world size 2" in msg and "= 3" in msg and "--nproc-per-node 3" in msg
    assert "\n" not in msg


def test_engine_may_not_straddle_nodes():
    with pytest.raises(ValueError, match="straddles two nodes"):
        compute_layout(8, 4, trainer_ranks=2, engines=2, tp=3)


def test_uneven_nodes_rejected():
    with pytest.raises(ValueError, match="whole number of nodes"):
        compute_layout(6, 4, trainer_ranks=2, engines=4, tp=1)


def test_bad_counts_rejected():
    with pytest.raises(ValueError, match="generator.tp"):
        compute_layout(3, 3, trainer_ranks=3, engines=1, tp=0)


def test_env_from_torchrun_and_slurm():
    tr = from_environ({"TORCHELASTIC_RUN_ID": "x", "RANK": "2", "WORLD_SIZE": "3",
                       "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "h",
                       "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (tr.rank, tr.world_size, tr.launcher, tr.agent_store) == (2, 3, "torchrun", True)
    sl = from_environ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_NNODES": "2",
                       "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]",
                       "SLURM_JOB_ID": "123"})
    assert (sl.rank, sl.local_world_size, sl.master_addr, sl.agent_store) == (5, 4, "gpu07",
                                                                              False)
    assert from_environ({}) is None
    assert _first_host("node1,node2") == "node1"
