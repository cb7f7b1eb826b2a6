"""The GPU check (``make gpu-check``): rlmetrics on one CUDA device, in one short run.

Run from the repository root with ``src`` on the path (``make gpu-check`` does both; it
installs nothing and needs no network)::

    PYTHONPATH=src python3 benchmarks/gpu_check.py --out gpu-check-results

Five parts, each guarded (a part that fails is recorded and the others still run; the
exit code is 1 if any failed):

* ``tests``: the tests that need a GPU or behave differently with one (``CUDA_TESTS``),
  under pytest in a subprocess: passed, failed, skipped.
* ``demo``: a few steps of the demo trainer (``rlmetrics demo --dp 1 --device cuda``,
  in this process) with every log call under ``torch.cuda.set_sync_debug_mode("error")``:
  a host sync inside a log call raises there and fails the part. ``compute()`` and the
  trainer's own work run in the default mode (they sync by design). One rank: two ranks
  cannot share one GPU under NCCL, and spawned ranks would not carry the guard.
* ``kernels``: device activities (kernels and copies, by ``torch.profiler``) and torch
  ops (by a ``TorchDispatchMode``) per log call, over 1,000 log calls of device tensors
  with a bool mask; expected 0. Counted against an empty call's; a control (``x + 1``)
  shows the profiler counts kernels. Then calls past ``record_limit`` (a fold inside the
  log call) under the sync guard, and their value checked.
* ``compute``: ``compute(sync=False)`` of 512 metrics (mean, sum, max and min in turn),
  one call each of python floats, of 0-d device tensors or of 1k-element device tensors
  with a bool mask: the median µs over repeats (the log calls untimed).
* ``fold``: the whole step (log calls, then ``compute(sync=False)``, the device
  synchronised before and after) over 4M float32 elements with a bool mask in 4 calls,
  in ns per element for mean, sum, max and min; beside it the verl-style eager way (each
  call reduced on the device and read with ``.item()``), interleaved with it.

Without a CUDA device, or with ``--dry-run``, it runs the same parts on the CPU with tiny
sizes, in well under a minute (``tests/benchmarks/test_gpu_check.py`` runs it in ``make test``):
only the tests named for a device (``-k "cuda or device"``), which skip or check the
CPU's side, and nothing is guarded or profiled on a device.

It writes ``gpu_check.json`` into ``--out`` (every number, and the markdown table it
prints under the key ``table_md``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import rlmetrics
from rlmetrics import Tracker
from rlmetrics.tracker import PrefixedTracker

from op_count import OpCounter

ROOT = Path(__file__).resolve().parents[1]
RESULT_FILE = "gpu_check.json"
KINDS = ("mean", "sum", "max", "min")
# Values are float32 drawn around 1 (so that a relative error means something): what
# a result may be off by relative to the exact float64 one, float32 accumulation allowed.
TOLERANCE = 1e-5
CUDA_TESTS = (
    "tests/unit/test_cuda.py",
    "tests/unit/cli/test_cli.py",
    "tests/unit/test_timing.py::test_cuda_timer_records_events_without_a_sync_and_reads_them_at_compute",
    "tests/unit/test_groups.py::test_cuda_grouped_calls_never_sync_at_the_call_and_match_the_cpu",
    "tests/unit/test_reliability_input.py::test_a_masked_array_with_a_device_weight_names_the_metric",
    "tests/unit/integrations/test_tensordict.py::test_device_and_dtype_moves_leave_the_state_alone",
    "tests/multiprocess/test_trainer.py::test_jsonl_has_verl_names",
)
# The Tracker methods a log call enters by (the public calls and the internal ones the
# prefixed views, groups and timers forward to).
# fmt: off
LOG_METHODS = ("mean", "sum", "max", "min", "std", "last", "dist", "quantile", "log",
               "log_shared", "elapsed", "throughput", "_log", "_log_shared", "_log_by",
               "_grouped")
TINY_MODEL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--num-prompts", "4",
              "--samples-per-prompt", "2", "--num-symbols", "3", "--max-prompt-len", "2"]
# fmt: on


def sizes(dry: bool) -> dict[str, int]:
    """The run's sizes: the real ones on a GPU, tiny ones for the CPU dry run."""
    if dry:
        return {
            "demo_steps": 2,
            "log_calls": 200,
            "metrics": 512,
            "compute_repeats": 5,
            "fold_elements": 1 << 16,
            "fold_calls": 4,
            "fold_repeats": 3,
        }
    return {
        "demo_steps": 5,
        "log_calls": 1000,
        "metrics": 512,
        "compute_repeats": 30,
        "fold_elements": 1 << 22,
        "fold_calls": 4,
        "fold_repeats": 20,
    }


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- tests -------------------------------------------------------------------------------
def part_tests(device: torch.device, size: dict[str, int]) -> dict[str, Any]:
    """``CUDA_TESTS`` under pytest in a subprocess (this tree's ``src`` first on the path);
    on the CPU only those named for a device (they skip there, or check the CPU's side)."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-tests-") as tmp:
        junit = Path(tmp) / "junit.xml"
        env = {
            **os.environ,
            "TMPDIR": tmp,
            "HOME": tmp,
            "RAY_AUTH_MODE": "disabled",
            "MPLCONFIGDIR": str(Path(tmp) / "mpl"),
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rfEs",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            *CUDA_TESTS,
            *(["-k", "cuda or device"] if device.type == "cpu" else []),
        ]
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200, check=False
        )
        output = (done.stdout + done.stderr).splitlines()
        print("\n".join(output[-30:]))
        counts = junit_counts(junit) if junit.exists() else {}
    failed = counts.get("failed", 0) + counts.get("errors", 0)
    ok = done.returncode == 0 and bool(counts) and failed == 0
    return {
        "ok": ok,
        "returncode": done.returncode,
        **counts,
        "command": " ".join(["pytest", *command[3:]]),
        "tail": [] if ok else output[-15:],
    }


def junit_counts(path: Path) -> dict[str, Any]:
    """passed, failed, errors, skipped and the failing tests' names of a JUnit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {
        key: sum(int(s.get(key, 0)) for s in suites)
        for key in ("tests", "failures", "errors", "skipped")
    }
    bad = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in root.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return {
        "passed": passed,
        "failed": total["failures"],
        "errors": total["errors"],
        "skipped": total["skipped"],
        "failing": bad,
    }


# -- demo --------------------------------------------------------------------------------
class SyncGuard:
    """While active, every log call (of a Tracker or a prefixed view) runs under
    ``set_sync_debug_mode("error")`` on a CUDA device (a host sync inside it raises),
    and the calls are counted (a call entering another counts once)."""

    def __init__(self, device: torch.device) -> None:
        self.armed = device.type == "cuda"
        self.calls = 0
        self.device_calls = 0  # calls given a tensor on the device
        self.depth = 0
        self.saved: dict[tuple[type, str], Any] = {}

    def wrap(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self.depth == 0:
                self.calls += 1
                values = [*args, *kwargs.values()]
                self.device_calls += any(
                    isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in values
                )
            self.depth += 1
            before = torch.cuda.get_sync_debug_mode() if self.armed else 0
            if self.armed:
                torch.cuda.set_sync_debug_mode("error")
            try:
                return method(*args, **kwargs)
            finally:
                if self.armed:
                    torch.cuda.set_sync_debug_mode(before)
                self.depth -= 1

        return guarded

    def __enter__(self) -> SyncGuard:
        for cls in (Tracker, PrefixedTracker):
            for name in LOG_METHODS:
                if hasattr(cls, name):
                    self.saved[cls, name] = vars(cls).get(name)
                    setattr(cls, name, self.wrap(getattr(cls, name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for (cls, name), original in self.saved.items():
            if original is None:
                delattr(cls, name)  # it was inherited
            else:
                setattr(cls, name, original)
        if self.armed:
            torch.cuda.set_sync_debug_mode(0)


def guard_control(device: torch.device) -> bool:
    """Does the sync debug mode raise here? (``.item()`` of a device tensor must.)"""
    if device.type != "cuda":
        return False
    x = torch.ones(2, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        x.sum().item()
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return False


def part_demo(device: torch.device, size: dict[str, int]) -> dict[str, Any]:
    """``rlmetrics demo --dp 1 --device <device>`` for a few steps, log calls guarded."""
    from rlmetrics.cli import main

    armed = guard_control(device)
    if device.type == "cuda" and not armed:
        return {"ok": False, "error": "set_sync_debug_mode('error') did not raise on .item()"}
    model = TINY_MODEL if device.type == "cpu" else []
    with tempfile.TemporaryDirectory(prefix="gpu-check-demo-") as tmp:
        jsonl = Path(tmp) / "metrics.jsonl"
        flags = ["--dp", "1", "--device", str(device), "--steps", str(size["demo_steps"])]
        argv = [
            "demo",
            *flags,
            "--loggers",
            "jsonl",
            "--run-dir",
            tmp,
            "--metrics-jsonl",
            str(jsonl),
            "--log-every",
            "0",
            "--no-progress",
            *model,
        ]
        start = time.perf_counter()
        with SyncGuard(device) as guard:
            try:
                code = main(argv)
            except Exception as err:  # a sync in a log call raises here: say where
                return {"ok": False, **failure(err), "guarded_log_calls": guard.calls}
        seconds = time.perf_counter() - start
        rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    memory = [row.get("actor/perf/max_memory_allocated_gb") for row in rows]
    on_device = device.type != "cuda" or all(m is not None and m > 0 for m in memory)
    ok = code == 0 and len(rows) == size["demo_steps"] and on_device and guard.calls > 0
    return {
        "ok": ok,
        "command": " ".join(["rlmetrics demo", *flags, *model]),
        "steps": len(rows),
        "seconds": round(seconds, 2),
        "guarded_log_calls": guard.calls,
        "log_calls_with_device_tensors": guard.device_calls,
        "sync_guard": armed,
        "score_first_last": [rows[0].get("critic/score/mean"), rows[-1].get("critic/score/mean")]
        if rows
        else None,
    }


# -- kernels per log call ----------------------------------------------------------------
def masked_inputs(n: int, elements: int, device: torch.device) -> list[tuple[Any, Any]]:
    """``n`` (values, bool mask) pairs of ``elements`` float32 elements on ``device``."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randn(elements, generator=gen) + 1.0
        out.append((x.to(device), (torch.rand(elements, generator=gen) < 0.7).to(device)))
    return out


def device_activities(
    call: Callable[[], Any], device: torch.device
) -> tuple[int | None, int, dict[str, int]]:
    """What ``torch.profiler`` records for ``call`` (the device synchronised after it):
    device activities (kernels, copies, memsets; None on the CPU), aten ops on the
    host, and the device activities' names with their counts."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sync(device)
    with profile(activities=activities) as prof:
        call()
        sync(device)
    events = prof.events()
    host_ops = sum(
        1 for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")
    )
    if device.type != "cuda":
        return None, host_ops, {}
    listed = [e.name for e in events if e.device_type == DeviceType.CUDA]
    attached = [k.name for e in events for k in (getattr(e, "kernels", None) or ())]
    names = listed if len(listed) >= len(attached) else attached
    return len(names), host_ops, dict(Counter(names).most_common(8))


def part_kernels(device: torch.device, size: dict[str, int]) -> dict[str, Any]:
    """Device activities and torch ops per log call over ``log_calls`` masked calls."""
    n = size["log_calls"]
    inputs = masked_inputs(16, 1024, device)
    kinds = ("mean", "sum", "max", "min", "std", "dist")
    t = Tracker()
    t.copy_cpu_tensors = False  # a dry run's CPU tensors stand for device ones: no copy

    def calls() -> None:
        for i in range(n):
            x, m = inputs[i % len(inputs)]
            getattr(t, kinds[i % len(kinds)])(f"m{i % 24}", x, weight=m)

    x0 = inputs[0][0]
    baseline, _, _ = device_activities(lambda: None, device)  # the profiler's own, if any
    control, _, _ = device_activities(lambda: x0 + 1, device)
    calls()  # first calls create the metrics; count the steady state
    t.compute(sync=False)
    kernels, host_ops, names = device_activities(calls, device)
    t.compute(sync=False)
    if kernels is not None:
        kernels, control = kernels - baseline, control - baseline
    with SyncGuard(device), OpCounter() as ops:
        calls()
    got = t.compute(sync=False)["m0"]  # a mean: the calls i = 0, 24, 48, ...
    error = relative_error(got, [inputs[i % len(inputs)] for i in range(0, n, 24)])
    # past record_limit a log call folds what the tracker holds: on the device, that
    # fold must not sync either
    early, early_failure = Tracker(), {}
    early.record_limit = 4 * 1024
    early.copy_cpu_tensors = False
    with SyncGuard(device) as guard:
        try:
            for x, m in inputs * 4:
                early.mean("m", x, weight=m)
            early_error = relative_error(early.compute(sync=False)["m"], inputs * 4)
        except Exception as err:
            early_failure, early_error = failure(err), float("nan")
    ok = ops.total == 0 and host_ops == 0 and kernels in (None, 0)
    ok = ok and error <= TOLERANCE and early_error <= TOLERANCE
    note = {}
    if device.type == "cuda" and not control:
        ok = False
        note = {"note": "the profiler saw no device activity for x + 1: its counts mean "
                "nothing here (the torch-op count stands)"}  # fmt: skip
    return {
        **note,
        **{f"early_fold_{key}": value for key, value in early_failure.items()},
        "ok": ok,
        "log_calls": n,
        "elements_per_call": 1024,
        "device_activities": kernels,
        "torch_ops": ops.total,
        "profiled_host_ops": host_ops,
        "per_call": None if kernels is None else kernels / n,
        "control_activities_x_plus_1": control,
        "profiler_baseline": baseline,
        "device_activity_names": names,
        "ops": dict(ops.ops),
        "m0_relative_error": float(f"{error:.3g}"),
        "early_fold_guarded_calls": guard.calls,
        "early_fold_relative_error": float(f"{early_error:.3g}"),
    }


def relative_error(got: float, pieces: list[tuple[Any, Any]]) -> float:
    """|got - the exact masked mean of ``pieces``| / |that mean|."""
    want = reference("mean", torch.cat([x for x, _ in pieces]), torch.cat([m for _, m in pieces]))
    return abs(got - want) / abs(want)


# -- compute() of 512 metrics ------------------------------------------------------------
def part_compute(device: torch.device, size: dict[str, int]) -> dict[str, Any]:
    """Median µs of ``compute(sync=False)`` over 512 metrics, by input."""
    n, repeats = size["metrics"], size["compute_repeats"]
    names = [f"metric/{i}" for i in range(n)]
    gen = torch.Generator().manual_seed(1)
    scalars = [torch.randn((), generator=gen).to(device) for _ in range(n)]
    tensors = masked_inputs(n, 1024, device)
    floats = [float(s) for s in scalars]
    inputs: dict[str, Callable[[Tracker, int], None]] = {
        "python floats": lambda t, i: getattr(t, KINDS[i % 4])(names[i], floats[i]),
        "0-d tensors": lambda t, i: getattr(t, KINDS[i % 4])(names[i], scalars[i]),
        "1k-element tensors, bool mask": lambda t, i: getattr(t, KINDS[i % 4])(
            names[i], tensors[i][0], weight=tensors[i][1]
        ),
    }
    out: dict[str, float] = {}
    for label, log in inputs.items():
        t, samples = Tracker(), []
        for r in range(repeats + 3):
            for i in range(n):
                log(t, i)
            sync(device)
            start = time.perf_counter()
            result = t.compute(sync=False)
            seconds = time.perf_counter() - start
            if r >= 3:
                samples.append(seconds)
        if len(result) != n:
            raise AssertionError(f"{label}: compute() gave {len(result)} metrics, not {n}")
        out[label] = round(statistics.median(samples) * 1e6, 1)
    return {"ok": True, "metrics": n, "repeats": repeats, "median_us": out}


# -- the fold's ns per element -----------------------------------------------------------
def eager(kind: str, x: torch.Tensor, m: torch.Tensor) -> float:
    """The verl-style reduction of one call: on the device, then read with ``.item()``."""
    if kind == "mean":
        return ((x * m).sum() / m.sum()).item()
    if kind == "sum":
        return (x * m).sum().item()
    fill = float("-inf") if kind == "max" else float("inf")
    picked = torch.where(m, x, torch.full_like(x, fill))
    return (picked.max() if kind == "max" else picked.min()).item()


def reference(kind: str, x: torch.Tensor, m: torch.Tensor) -> float:
    """The exact value over the whole batch, in float64."""
    chosen = x.double()[m]
    return float(
        {"mean": chosen.mean, "sum": chosen.sum, "max": chosen.max, "min": chosen.min}[kind]()
    )


def part_fold(device: torch.device, size: dict[str, int]) -> dict[str, Any]:
    """ns per element of a whole step (log calls + compute) against the eager way."""
    n, calls, repeats = size["fold_elements"], size["fold_calls"], size["fold_repeats"]
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(n, generator=gen) + 1.0).to(device)
    m = (torch.rand(n, generator=gen) < 0.7).to(device)
    pieces = list(zip(x.chunk(calls), m.chunk(calls), strict=True))
    ours: dict[str, float] = {}
    theirs: dict[str, float] = {}
    error: dict[str, float] = {}
    for kind in KINDS:
        t = Tracker()

        def rlmetrics_step(t: Tracker = t, kind: str = kind) -> float:
            log = getattr(t, kind)
            for xs, ms in pieces:
                log("x", xs, weight=ms)
            return t.compute(sync=False)["x"]

        def eager_step(kind: str = kind) -> float:
            values = [eager(kind, xs, ms) for xs, ms in pieces]
            return {"mean": statistics.fmean, "sum": sum, "max": max, "min": min}[kind](values)

        samples: dict[str, list[float]] = {"rlmetrics": [], "eager": []}
        for r in range(repeats + 2):
            for label, step in (("rlmetrics", rlmetrics_step), ("eager", eager_step)):
                sync(device)
                start = time.perf_counter()
                value = step()
                sync(device)
                if r >= 2:
                    samples[label].append(time.perf_counter() - start)
                if label == "rlmetrics":
                    got = value
        want = reference(kind, x, m)
        error[kind] = abs(got - want) / max(abs(want), 1e-30)
        ours[kind] = round(statistics.median(samples["rlmetrics"]) / n * 1e9, 4)
        theirs[kind] = round(statistics.median(samples["eager"]) / n * 1e9, 4)
    ok = all(e <= TOLERANCE for e in error.values())
    return {
        "ok": ok,
        "elements": n,
        "calls": calls,
        "repeats": repeats,
        "ns_per_element": ours,
        "eager_ns_per_element": theirs,
        "relative_error": {k: float(f"{e:.3g}") for k, e in error.items()},
    }


# -- the run -----------------------------------------------------------------------------
PARTS: dict[str, Callable[[torch.device, dict[str, int]], dict[str, Any]]] = {
    "tests": part_tests,
    "demo": part_demo,
    "kernels": part_kernels,
    "compute": part_compute,
    "fold": part_fold,
}


def failure(err: BaseException) -> dict[str, Any]:
    """An exception's readings (printed too): its type and message, the traceback's last
    lines and its frames in rlmetrics (where a sync inside a log call came from)."""
    lines = traceback.format_exception(err)
    text = "".join(lines).splitlines()
    print("\n".join(text[-25:]), flush=True)
    frames = [line.strip() for line in text if "/rlmetrics/" in line]
    return {
        "error": f"{type(err).__name__}: {err}"[:500],
        "traceback": text[-8:],
        "rlmetrics_frames": frames[-6:],
    }


def run_part(name: str, device: torch.device, size: dict[str, int]) -> dict[str, Any]:
    """One part, its failure recorded (type, message, the traceback's last lines)."""
    print(f"== {name}", flush=True)
    start = time.perf_counter()
    try:
        result = PARTS[name](device, size)
    except Exception as err:  # a failing part must not stop the others
        result = {"ok": False, **failure(err)}
    finally:
        with contextlib.suppress(Exception):
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
    result["seconds"] = round(time.perf_counter() - start, 2)
    print(f"   {'ok' if result['ok'] else 'FAILED'} in {result['seconds']} s", flush=True)
    return result


def table(results: dict[str, Any]) -> str:
    """The short markdown summary of a run."""
    p = results["parts"]
    lines = [
        f"GPU check on {results['device']} ({results['mode']}), torch {results['torch']}, "
        f"{results['seconds']} s",
        "",
        "| part | status | reading |",
        "| --- | --- | --- |",
    ]

    def row(name: str, reading: Callable[[dict[str, Any]], str]) -> None:
        part = p[name]
        text = part["error"] if "error" in part else _safe(reading, part)
        lines.append(f"| {name} | {'ok' if part['ok'] else 'FAILED'} | {text} |")

    row(
        "tests",
        lambda t: (
            f"{t['passed']} passed, {t['failed']} failed, {t['errors']} "
            f"errors, {t['skipped']} skipped"
        ),
    )
    row(
        "demo",
        lambda d: (
            f"{d['steps']} steps; {d['guarded_log_calls']} log calls guarded "
            f"({d['log_calls_with_device_tensors']} with device tensors), sync guard "
            f"{'armed' if d['sync_guard'] else 'off (no CUDA)'}"
        ),
    )
    row(
        "kernels",
        lambda k: (
            f"{k['per_call']} device activities (kernels, copies) per log call "
            f"(control x + 1: {k['control_activities_x_plus_1']}), "
            f"{k['torch_ops'] / k['log_calls']:g} torch ops, over {k['log_calls']} masked "
            f"calls; {k['early_fold_guarded_calls']} calls folding past record_limit, guarded"
            if k["device_activities"] is not None
            else f"no device: {k['torch_ops'] / k['log_calls']:g} torch ops per log call "
            f"over {k['log_calls']} masked calls"
        ),
    )
    row(
        "compute",
        lambda c: (
            ", ".join(f"{label} {us:g} µs" for label, us in c["median_us"].items())
            + f" ({c['metrics']} metrics, median of {c['repeats']})"
        ),
    )
    row(
        "fold",
        lambda f: f"{f['elements']:,} elements in {f['calls']} calls, median of {f['repeats']}",
    )
    fold = p["fold"]
    if "ns_per_element" in fold:
        lines += [
            "",
            "| kind | rlmetrics ns/element | eager (.item() per call) ns/element "
            "| ratio | relative error |",
            "| --- | --- | --- | --- | --- |",
        ]
        for kind in KINDS:
            ours, theirs = fold["ns_per_element"][kind], fold["eager_ns_per_element"][kind]
            ratio = ours / theirs if theirs else float("nan")
            lines.append(
                f"| {kind} | {ours:.3g} | {theirs:.3g} | {ratio:.2f} | "
                f"{fold['relative_error'][kind]:.2g} |"
            )
    return "\n".join(lines)


def _safe(reading: Callable[[dict[str, Any]], str], part: dict[str, Any]) -> str:
    try:
        return reading(part)
    except (KeyError, TypeError, ValueError) as err:
        return f"(no reading: {err!r})"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu-check-results", help="folder for gpu_check.json")
    parser.add_argument(
        "--dry-run", action="store_true", help="the CPU with tiny sizes (automatic without CUDA)"
    )
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu") if dry else torch.device("cuda", 0)
    names = [n for n in args.parts.split(",") if n]
    unknown = sorted(set(names) - set(PARTS))
    if unknown:
        raise SystemExit(f"--parts: unknown {unknown}; known: {list(PARTS)}")
    size = sizes(dry)
    start = time.perf_counter()
    parts = {name: run_part(name, device, size) for name in names}
    results = {
        "mode": "dry-run (CPU)" if dry else "cuda",
        "device": torch.cuda.get_device_name(device) if not dry else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "rlmetrics": str(Path(rlmetrics.__file__).parent),
        "seconds": round(time.perf_counter() - start, 1),
        "sizes": size,
        "ok": all(p["ok"] for p in parts.values()),
        "parts": parts,
    }
    for name in PARTS:  # a part left out by --parts reads as such in the table
        parts.setdefault(name, {"ok": True, "error": "not run (--parts)"})
    results["table_md"] = table(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULT_FILE).write_text(json.dumps(results, indent=1) + "\n")
    print(results["table_md"])
    print(f"wrote {out / RESULT_FILE}; {'all parts ok' if results['ok'] else 'a part FAILED'}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
