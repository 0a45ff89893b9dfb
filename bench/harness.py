"""How a benchmark is run, timed and written: the part every bench/*.py repeats, in one place,
so that every result file in bench/results/ says the same things about itself (what ran, on
which commit, on what machine, with which parameters, when) and a figure quoted in
docs/measured/ can be traced back to the command that made it.

A result file is one JSON object:

    benchmark   the bench's name: bench/<benchmark>.py
    command     the command line that wrote it (`torchrun ...` under torchrun)
    commit      git HEAD of the checkout it ran in, '+dirty' when the tree had changes
    date_utc    when it was written, 'YYYY-MM-DD HH:MM UTC'
    machine     CPU model, cores, memory, torch and its threads, accelerators
    params      the bench's parameters: its parsed command line (but --out and --notes)
    notes       free text from --notes (what the machine was doing, why the run was made)
    every other key: the bench's measurements, under the names it has always written: the
    medians, with the raw repeats beside them (lists named *_all), so the docs and tests that
    read older files read new ones the same way.

A bench uses it as bench/data_path.py does:

    ap = bench_parser("data_path", __doc__, repeats=30)
    args = ap.parse_args()
    seconds = time_calls(work, args.repeats)
    write_result("data_path", {"work_s_median": median(seconds), "work_s_all": seconds}, args)

Benches run from the repository root (`make bench` does), as `python bench/<name>.py` or
under torchrun; this module is imported as `harness` from bench/ (bench/ is no package: the
script's directory is on sys.path)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# The keys write_result adds; a bench's measurements may not use them.
SCHEMA_KEYS = ("benchmark", "command", "commit", "date_utc", "machine", "params", "notes")


def bench_parser(name: str, doc: str | None, repeats: int | None = None,
                 out: str | Path | None = None) -> argparse.ArgumentParser:
    """The command line every bench has: --out (default bench/results/<name>.json, or `out`;
    an empty `out` leaves the default to the bench, e.g. a name that depends on the machine),
    --notes, and --repeats when the bench takes a default number of repeats. The bench adds
    its own arguments to the parser it gets back."""
    first = (doc or "").strip().split("\n\n")[0].replace("\n", " ")
    ap = argparse.ArgumentParser(description=first or None)
    default = str(RESULTS / f"{name}.json") if out is None else str(out)
    ap.add_argument("--out", default=default,
                    help=f"the result file (default {default or 'chosen by the bench'})")
    ap.add_argument("--notes", default="", help="free text written into the result")
    if repeats is not None:
        ap.add_argument("--repeats", type=int, default=repeats,
                        help=f"timed repeats (default {repeats})")
    return ap


def time_calls(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`, after `warmup` calls left untimed (the first
    call pays for allocations, compiled kernels, oneDNN's primitives)."""
    for _ in range(warmup):
        fn()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
    return seconds


def median(xs) -> float:
    """The median, NaN for no values (a bench whose every step was skipped still writes)."""
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def git_commit() -> str:
    """HEAD of the checkout this file is in, '+dirty' when tracked files differ from it; ''
    outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+dirty" if dirty.strip() else "")


def machine() -> dict:
    """What the figures depend on: the CPU (its model and torch's kernel capability: AVX2,
    AVX512, AMX), the cores this process may use, memory, torch and its threads, and the
    accelerators torch sees."""
    out = {"cpu_model": platform.processor() or platform.machine(),
           "cores": os.cpu_count(), "python": platform.python_version(),
           "platform": platform.platform()}
    try:
        with open("/proc/cpuinfo") as f:
            out["cpu_model"] = next(line.split(":", 1)[1].strip() for line in f
                                    if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if hasattr(os, "sched_getaffinity"):
        out["cores_usable"] = len(os.sched_getaffinity(0))
    try:
        out["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                                  / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    try:
        import torch
    except ImportError:
        return out
    out["torch"] = torch.__version__
    out["torch_threads"] = torch.get_num_threads()
    out["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    if torch.cuda.is_available():
        out["accelerators"] = [torch.cuda.get_device_name(i)
                               for i in range(torch.cuda.device_count())]
    return out


def command_line() -> str:
    """This process's command line as it would be typed from the repository root; under
    torchrun (LOCAL_WORLD_SIZE set) the launch that started it."""
    script = Path(sys.argv[0]).resolve()
    shown = str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else sys.argv[0]
    args = shlex.join([shown, *sys.argv[1:]])
    if "LOCAL_WORLD_SIZE" in os.environ:
        return f"torchrun --standalone --nproc-per-node {os.environ['LOCAL_WORLD_SIZE']} {args}"
    return f"python {args}"


def write_result(benchmark: str, measurements: dict, args: argparse.Namespace | None = None,
                 out: str | Path | None = None, notes: str | None = None) -> Path:
    """Write `measurements` with the schema's keys (module docstring) to `out`, else to
    args.out, else to bench/results/<benchmark>.json; `args` gives the params (but out and
    notes) and, unless `notes` is given, the notes. Returns the path written."""
    clash = sorted(set(SCHEMA_KEYS) & set(measurements))
    if clash:
        raise ValueError(f"{benchmark}: measurement keys {clash} are the schema's own")
    params = {k: v for k, v in vars(args).items() if k not in ("out", "notes")} if args else {}
    if notes is None:
        notes = getattr(args, "notes", "") or ""
    path = Path(out or getattr(args, "out", "") or RESULTS / f"{benchmark}.json")
    result = {"benchmark": benchmark, "command": command_line(), "commit": git_commit(),
              "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": machine(), "params": params, "notes": notes, **measurements}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return path
