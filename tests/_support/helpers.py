"""Shared test helpers: numpy references, input representations, merge trees, a sync trap."""

from __future__ import annotations

import itertools
import math
import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlmetrics import Tracker, TrackerState

QUANTILES = (0.5, 0.9, 0.99)
SRC_DIR = Path(__file__).resolve().parents[2] / "src"
RTOL = 1e-12


# -- numpy references -------------------------------------------------------------------
def reference(kind: str, name: str, x: np.ndarray, w: np.ndarray | None) -> dict[str, float]:
    """What ``Tracker.compute()`` must report for ``x`` (weights/mask ``w``), by numpy."""
    x = np.asarray(x, dtype=np.float64)
    wf = np.ones_like(x) if w is None else np.asarray(w, dtype=np.float64)
    x, wf = x[wf > 0], wf[wf > 0]  # weight 0 contributes nothing, NaN and inf included
    kept = x
    if kind == "mean":
        return {} if wf.sum() == 0 else {name: float(np.sum(wf * x) / np.sum(wf))}
    if kind == "std":
        if wf.sum() == 0:
            return {}
        avg = np.sum(wf * x) / np.sum(wf)
        return {name: float(np.sqrt(np.sum(wf * (x - avg) ** 2) / np.sum(wf)))}
    if kind == "last":
        return {} if x.size == 0 else {name: float(x[-1])}
    if kept.size == 0:
        return {}
    if kind == "sum":
        return {name: float(np.sum(wf * x))}
    if kind == "max":
        return {name: float(kept.max())}
    if kind == "min":
        return {name: float(kept.min())}
    assert kind == "dist", kind
    out = {
        f"{name}/mean": float(kept.mean()),
        f"{name}/std": float(kept.std()),
        f"{name}/min": float(kept.min()),
        f"{name}/max": float(kept.max()),
    }
    for q, value in zip(QUANTILES, np.quantile(kept, QUANTILES), strict=True):
        out[f"{name}/p{round(q * 100, 6):g}"] = float(value)
    return out


EXACT_SUFFIXES = ("/min", "/max", "/p50", "/p90", "/p99")


def is_exact(kind: str, key: str) -> bool:
    """Results that involve no arithmetic, so must match bit for bit."""
    return kind in ("max", "min", "last") or key.endswith(EXACT_SUFFIXES) or "nonfinite" in key


def scale_of(kind: str, x: np.ndarray, w: np.ndarray | None) -> float:
    """The magnitude that rounding errors of ``kind`` on ``x`` scale with."""
    x = np.asarray(x, dtype=np.float64)
    finite = np.isfinite(x)
    if w is not None:
        finite &= np.asarray(w, dtype=np.float64) > 0
    values = np.abs(x[finite])
    if values.size == 0:
        return 0.0
    return float(values.sum() if kind == "sum" else values.max())


def assert_results(
    actual: dict[str, float], expected: dict[str, float], kind: str, scale: float
) -> None:
    """Same keys; exact results equal; others within RTOL of max(|a|, |b|, scale)."""
    assert sorted(actual) == sorted(expected), (actual, expected)
    for key, want in expected.items():
        got = actual[key]
        if math.isnan(want):
            assert math.isnan(got), (key, got, want)
        elif is_exact(kind, key):
            assert got == want, (key, got, want)
        else:
            tol = RTOL * max(abs(got), abs(want), scale)
            assert abs(got - want) <= tol, (key, got, want, abs(got - want), tol)


# -- representations of one piece ----------------------------------------------------------
def _exact_in(x: np.ndarray, dtype: Any) -> bool:
    with np.errstate(all="ignore"):
        return bool(np.array_equal(x.astype(dtype).astype(np.float64), x, equal_nan=True))


def _exact_in_torch(x: np.ndarray, dtype: torch.dtype) -> bool:
    cast = torch.from_numpy(x).to(dtype).double().numpy()
    return bool(np.array_equal(cast, x, equal_nan=True))


def value_reps(x: np.ndarray) -> list[str]:
    """The representations that hold ``x`` exactly."""
    reps = ["py", "py0d", "list", "np64", "t64", "t64_2d"]
    if _exact_in(x, np.float32):
        reps += ["np32", "t32"]
    for name, dtype in (("t16", torch.float16), ("tbf16", torch.bfloat16)):
        if _exact_in_torch(x, dtype):
            reps.append(name)
    if np.all(np.isfinite(x)) and np.all(x == np.round(x)) and np.all(np.abs(x) < 2**31):
        reps += ["pyint", "ti64", "ti32"]
    return reps


def _torch_values(rep: str, x: np.ndarray) -> torch.Tensor:
    dtype = {
        "t64": torch.float64,
        "t64_2d": torch.float64,
        "t32": torch.float32,
        "t16": torch.float16,
        "tbf16": torch.bfloat16,
        "ti64": torch.int64,
        "ti32": torch.int32,
    }[rep]
    tensor = torch.from_numpy(x.copy()).to(dtype)
    if rep == "t64_2d" and x.size % 2 == 0:
        tensor = tensor.reshape(2, -1)
    return tensor


def _torch_weights(w: np.ndarray, like: torch.Tensor, rnd: random.Random) -> Any:
    if np.all((w == 0) | (w == 1)) and rnd.random() < 0.6:
        return torch.from_numpy(w > 0).reshape(like.shape)
    dtype = torch.float32 if _exact_in(w, np.float32) and rnd.random() < 0.5 else torch.float64
    return torch.from_numpy(w.copy()).to(dtype).reshape(like.shape)


def log_piece(
    log: Callable[..., None],
    x: np.ndarray,
    w: np.ndarray | None,
    rep: str,
    rnd: random.Random,
) -> None:
    """Log values ``x`` (weights or mask ``w``) through ``log(value[, weight])`` as ``rep``."""
    is_mask = w is not None and np.all((w == 0) | (w == 1))
    if rep in ("py", "pyint", "py0d"):
        for i, value in enumerate(x.tolist()):
            if rep == "pyint":
                value = int(value)
            elif rep == "py0d":
                value = torch.tensor(value, dtype=torch.float64)
            if w is None:
                log(value)
            elif is_mask and rnd.random() < 0.5:
                log(value, bool(w[i]))
            elif rep == "py0d" and rnd.random() < 0.5:
                log(value, torch.tensor(float(w[i]), dtype=torch.float64))
            else:
                log(value, float(w[i]))
        return
    if rep == "list":
        value: Any = x.tolist()
        weight: Any = None if w is None else w.tolist()
    elif rep in ("np64", "np32"):
        value = x.astype(np.float64 if rep == "np64" else np.float32)
        weight = None if w is None else (w > 0 if is_mask and rnd.random() < 0.5 else w.copy())
    else:
        value = _torch_values(rep, x)
        weight = None if w is None else _torch_weights(w, value, rnd)
    if weight is None:
        log(value)
    else:
        log(value, weight)


# -- partitions and merge trees ------------------------------------------------------------
def split(n: int, cuts: Sequence[int]) -> list[slice]:
    """Contiguous pieces of range(n) at ``cuts`` (repeats and ends give empty pieces)."""
    bounds = [0, *sorted(min(c, n) for c in cuts), n]
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def merge_tree(states: list[TrackerState], rnd: random.Random) -> TrackerState:
    """Merge ``states`` in a random binary tree, each node by a randomly chosen route."""
    if len(states) == 1:
        return states[0]
    k = rnd.randint(1, len(states) - 1)
    left, right = merge_tree(states[:k], rnd), merge_tree(states[k:], rnd)
    if rnd.random() < 0.5:
        left, right = right, left
    route = rnd.choice(("state", "tracker", "load"))
    if route == "state":
        return left.merge(right)
    tracker = Tracker()
    if route == "load":
        tracker.load_state_dict(left.to_dict())
    else:
        tracker.merge(left)
    return tracker.merge(right).state()


def merge_trackers(trackers: list[Tracker], rnd: random.Random) -> TrackerState:
    """Shuffle; fold some trackers into others directly; merge the states in a tree."""
    trackers = list(trackers)
    rnd.shuffle(trackers)
    while len(trackers) > 1 and rnd.random() < 0.3:
        other = trackers.pop()
        trackers[rnd.randrange(len(trackers))].merge(other)
    return merge_tree([t.state() for t in trackers], rnd)


# -- a tensor that refuses every host sync ---------------------------------------------------
class SyncTrap(torch.Tensor):
    """A tensor stand-in whose host-sync methods raise while ``armed``.

    torch's default ``__torch_function__`` makes the result of every op on a SyncTrap a
    SyncTrap, so the trap follows the data through the whole log path.
    """

    armed = True

    def _trap(self, method: str) -> None:
        if SyncTrap.armed:
            raise AssertionError(f"host sync in the log path: Tensor.{method}()")

    def item(self) -> Any:
        self._trap("item")
        return super().item()

    def tolist(self) -> Any:
        self._trap("tolist")
        return super().tolist()

    def __bool__(self) -> bool:
        self._trap("__bool__")
        return super().__bool__()

    def __float__(self) -> float:
        self._trap("__float__")
        return super().__float__()

    def __int__(self) -> int:
        self._trap("__int__")
        return super().__int__()

    def cpu(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._trap("cpu")
        return super().cpu(*args, **kwargs)

    def numpy(self, *args: Any, **kwargs: Any) -> np.ndarray:
        self._trap("numpy")
        return super().numpy(*args, **kwargs)


_as_tensor = torch.as_tensor  # bound now, so tests may guard torch.as_tensor itself


def trap(data: Any, dtype: torch.dtype = torch.float32) -> SyncTrap:
    """``data`` as an armed SyncTrap tensor."""
    return _as_tensor(data, dtype=dtype).as_subclass(SyncTrap)


def no_host_copies(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wrap ``torch.tensor``-like factories to raise while SyncTrap is armed.

    On CUDA, ``torch.tensor(x, device="cuda")`` is a blocking host-to-device copy (a
    stream sync); ``torch.full`` and ``new_full`` launch a fill kernel instead.
    """

    def guarded(*args: Any, **kwargs: Any) -> torch.Tensor:
        if SyncTrap.armed:
            raise AssertionError(f"host-to-device copy in the log path: torch.{factory.__name__}")
        return factory(*args, **kwargs)

    return guarded


def log_every_kind(tracker: Tracker, batch: dict[str, np.ndarray], idx: np.ndarray) -> None:
    """Log one micro-batch (rows ``idx`` of ``batch``: value, weight, mask) into every
    built-in kind; ``sometimes`` only for pieces starting at a multiple of 3, so some
    ranks or pieces lack it."""
    value = torch.from_numpy(batch["value"][idx])
    weight = torch.from_numpy(batch["weight"][idx])
    mask = torch.from_numpy(batch["mask"][idx])
    tracker.mean("m/mean", value, weight=weight)
    tracker.mean("m/masked", value, weight=mask)
    tracker.sum("m/sum", value, mask=mask)
    tracker.max("m/max", value, mask=mask)
    tracker.min("m/min", value)
    tracker.std("m/std", value, weight=weight)
    tracker.dist("m/dist", value, mask=mask)
    tracker.last("m/last", 0.25)
    if len(idx) and idx[0] % 3 == 0:
        tracker.mean("sometimes", value)  # a name only some ranks log


# -- fresh interpreters ----------------------------------------------------------------------
def run_python(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter that imports rlmetrics from this checkout."""
    env = {**os.environ, "PYTHONPATH": str(SRC_DIR)}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


class OpCounter(TorchDispatchMode):
    """Counts the torch operations dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@contextmanager
def tiny_switch_interval() -> Iterator[None]:
    """Threads switch every 1 µs, so that they interleave inside calls.

    The process runs on one CPU meanwhile (where the OS lets it choose): with two idle
    cores each forced switch hands the GIL from one core to the other, which costs tens
    of µs, and a test of 20,000 calls took 30 s instead of 1 s on an idle 2-core
    machine. On one core the switches interleave the threads as finely, cheaply."""
    interval = sys.getswitchinterval()
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_setaffinity") else None
    if cpus:
        os.sched_setaffinity(0, {min(cpus)})
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        if cpus:
            os.sched_setaffinity(0, cpus)
