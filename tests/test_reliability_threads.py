"""Threads sharing trackers: no call hangs, none is lost, every call lands whole in one step.

Each test makes the threads interleave inside calls (a 1 µs switch interval) and runs
many iterations; a hang is caught by a join timeout (the hung threads are daemons).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from rlmetrics import Tracker

JOIN_TIMEOUT = 10.0


@contextmanager
def tiny_switch_interval() -> Iterator[None]:
    """Threads switch every 1 µs, so that they interleave inside calls."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def run_threads(*targets: Callable[[], None]) -> None:
    """Run each target in a daemon thread; raise the first error, or AssertionError
    naming the threads still running after ``JOIN_TIMEOUT`` seconds (a hang)."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as error:
                errors.append(error)

        return run

    threads = [threading.Thread(target=guarded(t), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + JOIN_TIMEOUT
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    hung = [index for index, thread in enumerate(threads) if thread.is_alive()]
    assert not hung, f"threads {hung} of {len(threads)} still running after {JOIN_TIMEOUT} s"
    if errors:
        raise errors[0]


# -- merge: no deadlock ----------------------------------------------------------------
MERGE_ITERATIONS = 300


def merge_in_a_cycle(trackers: list[Tracker]) -> None:
    """Tracker i merges tracker i+1 (the last, the first), all threads at once."""
    barrier = threading.Barrier(len(trackers))

    def merge(index: int) -> Callable[[], None]:
        def run() -> None:
            barrier.wait()
            trackers[index].merge(trackers[(index + 1) % len(trackers)])

        return run

    run_threads(*(merge(index) for index in range(len(trackers))))


def expected(values: list[np.ndarray], weights: list[np.ndarray], parts: list[int]) -> dict:
    """What one tracker reports for the data of ``parts``, from numpy."""
    v = np.concatenate([values[p] for p in parts])
    w = np.concatenate([weights[p] for p in parts])
    return {"hi": float(v.max()), "m": float(np.average(v, weights=w)), "n": float(v.size)}


@pytest.mark.parametrize("size", [2, 3])
def test_trackers_merging_each_other_at_once_never_hang(size: int) -> None:
    """``a.merge(b)`` and ``b.merge(a)`` at once (and a cycle of three): every merge
    returns, and each tracker holds its own data plus a snapshot of the next one's,
    taken before or after that one's own merge (numbers checked against numpy)."""
    rng = np.random.default_rng(0)
    with tiny_switch_interval():
        for iteration in range(MERGE_ITERATIONS):
            values = [rng.integers(-8, 8, 3) / 4.0 for _ in range(size)]  # sums exact
            weights = [rng.integers(1, 4, 3).astype(np.float64) for _ in range(size)]
            trackers = [Tracker() for _ in range(size)]
            for tracker, value, weight in zip(trackers, values, weights, strict=True):
                tracker.mean("m", value, weight=weight)
                tracker.sum("n", float(len(value)))
                tracker.max("hi", value)
            merge_in_a_cycle(trackers)
            # tracker i holds i's data and a snapshot of i+1, which may hold i+1's own
            # merge of i+2's snapshot, and so on: parts i, i+1, ..., i+k (k <= size: a
            # snapshot taken after a merge was taken after that merge's own snapshot, so
            # at least one tracker holds the plain pair)
            plain = []
            for index, tracker in enumerate(trackers):
                got = tracker.compute()
                chains = [[(index + j) % size for j in range(k + 1)] for k in range(1, size + 1)]
                outcomes = [expected(values, weights, chain) for chain in chains]
                assert got in outcomes, (iteration, index, got, outcomes)
                plain.append(got == outcomes[0])
            assert any(plain), (iteration, "every tracker holds a longer chain: impossible")
