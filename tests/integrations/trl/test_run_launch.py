"""The tests' launcher: a launch that hangs is killed with its worker processes."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import grpo_runs
import pytest

# a parent that starts a child (as torchrun's agent starts its workers), writes the
# child's pid to a file, and both sleep far past the timeout
HANG = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
sys.stderr.write("waiting for a rank that never comes\\n")
sys.stderr.flush()
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(") ", 1)[1][0] != "Z"  # a zombie is dead too


def test_a_hung_launch_is_killed_workers_included(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    command = [sys.executable, "-c", HANG, str(pid_file)]
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="ran past 5 s") as raised:
        grpo_runs.run_launch(command, dict(os.environ), timeout=5)
    assert time.monotonic() - start < 60
    assert str(raised.value).rstrip().endswith("waiting for a rank that never comes")
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the launch's worker outlived it"


def test_a_launch_that_ends_returns_its_output() -> None:
    code = "import sys; print('out'); sys.stderr.write('err'); sys.exit(3)"
    done = grpo_runs.run_launch([sys.executable, "-c", code], dict(os.environ), timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err")
