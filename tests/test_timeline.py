from llamarl.plot import busy_share, chrome_trace
from llamarl.timeline import Timeline, read


def test_timeline_roundtrip_trace_and_busy_share(tmp_path):
    tl = Timeline(tmp_path, 0, "trainer 0")
    tl.record("wait_rollouts", 100.0, 101.0, 0)
    tl.record("train", 101.0, 102.0, 0)
    tl.close()
    Timeline(tmp_path, 1, "generator 0").record("generate", 100.5, 101.5, 0)
    events = read(tmp_path)
    assert len(events) == 3
    trace = chrome_trace(events)
    train = next(e for e in trace["traceEvents"] if e["name"] == "train")
    assert train["ts"] == 1_000_000 and train["dur"] == 1_000_000 and train["tid"] == 0
    share = busy_share(events)
    assert share["rank 0 (trainer 0)"] == 0.5  # waiting is not work
    assert share["rank 1 (generator 0)"] == 1.0
