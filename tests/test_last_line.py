"""A rank's last line (`watchdog.say`) reaches the shared stderr whole."""

import subprocess
import sys

from conftest import ROOT, child_env

WRITER = """
import sys, time
from llamarl.runtime.watchdog import say
who, start = sys.argv[1], float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))  # all start writing at once
for i in range(2000):
    say(f"llamarl: rank {who} (trainer {who}): line {i} " + "x" * 300)
"""


def test_lines_of_ranks_sharing_one_unbuffered_stderr_never_interleave():
    """Ranks under torchrun write to one pipe, often with PYTHONUNBUFFERED=1 (set here), where
    print() makes two writes (the text, then the newline) and another rank's line can land
    between them: a line then no longer starts with 'llamarl:'. say() makes one."""
    script = "; ".join([
        "import subprocess, sys, time",
        "start = str(time.time() + 3)",
        f"ps = [subprocess.Popen([sys.executable, '-c', {WRITER!r}, str(r), start]) "
        "for r in range(3)]",
        "sys.exit(max(p.wait() for p in ps))"])
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=child_env(),
                          stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 6000
    for line in lines:
        head, _, tail = line.partition(" line ")
        assert head in {f"llamarl: rank {r} (trainer {r}):" for r in range(3)}, line[:120]
        assert tail.split(" ")[1] == "x" * 300, line[:120]
