"""RUN_DIR/stop (trainer/stop.py): every trainer rank ends at the same version."""

from datetime import timedelta

import torch.distributed as dist

from llamarl.trainer.stop import StopRequest


def test_every_rank_ends_at_the_version_after_the_request(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    ranks = [StopRequest(store, tmp_path, r) for r in range(2)]
    assert not any(s.ends_at(3) for s in ranks)  # no file: run.steps decides
    assert not (tmp_path / "stop").exists()
    (tmp_path / "stop").touch()
    # rank 1 reads before trainer 0 looked (it may run ahead within the step): not yet
    assert not ranks[1].ends_at(4)
    assert not ranks[0].ends_at(4)  # trainer 0 sets the end at the next version, 5
    assert not (tmp_path / "stop").exists()  # read once: a resume in this directory goes on
    assert ranks[0].ends_at(5) and ranks[1].ends_at(5)
    (tmp_path / "stop").touch()  # a second request does not move the end
    assert ranks[0].ends_at(6) and ranks[0].at == 5
    assert not (tmp_path / "stop").exists()
