"""The GPU check's CPU dry run (``benchmarks/gpu_check.py --dry-run``), as ``make
gpu-check`` runs it on a machine without CUDA: every part runs and the results file
holds each part's readings. On a GPU ``make gpu-check`` runs the same parts for real."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a subprocess, which runs pytest and the trainer
def test_the_dry_run_runs_every_part_and_writes_its_readings(tmp_path: Path) -> None:
    out = tmp_path / "out"
    paths = [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "HOME": str(tmp_path), "TMPDIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(paths)}  # fmt: skip
    script = ROOT / "benchmarks" / "gpu_check.py"
    done = subprocess.run(
        [sys.executable, str(script), "--dry-run", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "gpu_check.json").read_text())
    assert results["mode"] == "dry-run (CPU)" and results["device"] == "cpu" and results["ok"]
    assert Path(results["rlmetrics"]) == ROOT / "src" / "rlmetrics"  # this tree's, not another
    parts = results["parts"]
    assert list(parts) == ["tests", "demo", "kernels", "compute", "fold"]
    assert all(part["ok"] and part["seconds"] >= 0 for part in parts.values())
    tests = parts["tests"]
    assert tests["passed"] > 0 and tests["skipped"] > 0 and tests["failed"] == tests["errors"] == 0
    demo = parts["demo"]
    assert demo["steps"] == results["sizes"]["demo_steps"] and demo["guarded_log_calls"] > 0
    assert demo["sync_guard"] is False and demo["log_calls_with_device_tensors"] == 0
    kernels = parts["kernels"]
    assert kernels["device_activities"] is None and kernels["torch_ops"] == 0
    assert kernels["m0_relative_error"] <= 1e-6 and kernels["early_fold_relative_error"] <= 1e-6
    compute = parts["compute"]
    assert compute["metrics"] == 512 and len(compute["median_us"]) == 3
    assert all(us > 0 for us in compute["median_us"].values())
    fold = parts["fold"]
    for key in ("ns_per_element", "eager_ns_per_element", "relative_error"):
        assert set(fold[key]) == {"mean", "sum", "max", "min"}
    assert all(e <= 1e-6 for e in fold["relative_error"].values())
    table = results["table_md"]
    assert "| tests | ok |" in table and "| mean |" in table
    assert table in done.stdout  # printed, too


@pytest.fixture(scope="module")
def gpu_check() -> Iterator[ModuleType]:
    """benchmarks/gpu_check.py, imported with benchmarks/ on sys.path for this module."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ROOT / "benchmarks"))
        yield importlib.import_module("gpu_check")


def test_the_sync_guard_sees_every_way_into_a_log_call_and_puts_them_back(
    gpu_check: ModuleType,
) -> None:
    """A call of the tracker, of a prefixed view, with by=, by kind name and a timer's:
    each counted once; afterwards the classes are what they were."""
    from rlmetrics import Tracker
    from rlmetrics.tracker import LogTarget, PrefixedTracker

    before = (dict(vars(LogTarget)), dict(vars(Tracker)), dict(vars(PrefixedTracker)))
    with gpu_check.SyncGuard(torch.device("cpu")) as guard:
        t = Tracker()
        t.mean("a", torch.ones(3), weight=torch.tensor([True, False, True]))
        t.prefixed("p/").sum("b", 1.0)
        t.mean("c", [1.0, 2.0], by=[0, 1])
        t.prefixed("q/").log("d", 2.0, kind="max")
        with t.timer("e"):
            pass
    assert guard.calls == 5 and guard.device_calls == 0 and not guard.armed
    assert {"a", "p/b", "c/0", "c/1", "q/d", "e"} <= set(t.compute())
    assert (dict(vars(LogTarget)), dict(vars(Tracker)), dict(vars(PrefixedTracker))) == before


def test_a_failing_part_is_recorded_and_the_exit_code_says_so(
    gpu_check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part that raises does not stop the others; the run then exits 1."""

    def broken(device: torch.device, size: dict[str, int]) -> dict[str, Any]:
        raise RuntimeError("planted failure")

    monkeypatch.setitem(gpu_check.PARTS, "demo", broken)
    code = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--parts", "demo,kernels"])
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 1 and results["ok"] is False
    assert results["parts"]["demo"]["ok"] is False
    assert results["parts"]["demo"]["error"] == "RuntimeError: planted failure"
    assert results["parts"]["kernels"]["ok"] is True
    assert "| demo | FAILED | RuntimeError: planted failure |" in results["table_md"]
