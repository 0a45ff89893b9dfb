"""bench/harness.py: every result file carries the schema's keys beside the bench's own
measurements (which keep their names, so the docs that quote older files read new ones), and
time_calls times only the calls after its warm-up."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("harness", BENCH / "harness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_result_has_the_schema_and_the_measurements(harness, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(BENCH / "data_path.py"), "--repeats", "2"])
    ap = harness.bench_parser("data_path", "The rollout data path.\n\nMore.", repeats=30)
    args = ap.parse_args(["--repeats", "2", "--out", str(tmp_path / "r.json"), "--notes", "x"])
    path = harness.write_result("data_path", {"after": {"total": 5.9}, "after_all": [1.0]}, args)
    result = json.loads(path.read_text())
    assert path == tmp_path / "r.json"
    assert set(harness.SCHEMA_KEYS) <= set(result)
    assert result["benchmark"] == "data_path" and result["notes"] == "x"
    assert result["params"] == {"repeats": 2}  # --out and --notes are the harness's own
    assert result["command"] == "python bench/data_path.py --repeats 2"
    assert result["after"] == {"total": 5.9} and result["after_all"] == [1.0]
    assert result["machine"]["cores"] >= 1 and "torch" in result["machine"]
    with pytest.raises(ValueError, match="schema"):
        harness.write_result("data_path", {"params": 1}, args)


def test_default_out_is_the_results_folder(harness):
    args = harness.bench_parser("logprob_memory", None, repeats=3).parse_args([])
    assert Path(args.out) == BENCH / "results" / "logprob_memory.json" and args.repeats == 3
    assert harness.bench_parser("cpu_dtype_matmul", None, out="").parse_args([]).out == ""


def test_time_calls_skips_the_warmup(harness):
    calls = []
    seconds = harness.time_calls(lambda: calls.append(1), repeats=3, warmup=2)
    assert len(calls) == 5 and len(seconds) == 3 and all(s >= 0 for s in seconds)
    assert harness.median([3.0, 1.0, 2.0]) == 2.0
