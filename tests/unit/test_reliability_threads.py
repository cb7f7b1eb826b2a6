"""Threads sharing trackers: no call hangs, none is lost, every call lands whole in one step.

Each test makes the threads interleave inside calls (a 1 µs switch interval) and runs
many iterations; a hang is caught by a join timeout (the hung threads are daemons).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

from rlmetrics import Tracker, TrackerState, Window
from rlmetrics.rl import MetricUpdate, log_updates

from helpers import tiny_switch_interval

JOIN_TIMEOUT = 30.0  # generous: a loaded CI machine still finishes well inside it


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
MERGE_ITERATIONS = 1000


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


# -- taking a step: no call lost --------------------------------------------------------
CALLS, ROUNDS = 20_000, 5


def take_with_tracker(tracker: Tracker) -> tuple[Callable[[], None], Callable[[], float]]:
    """Steps taken with ``Tracker.take_state()``; the totals from the merged states."""
    states: list[TrackerState] = []

    def step() -> None:
        states.append(tracker.take_state())

    def totals() -> dict[str, float]:
        states.append(tracker.take_state())
        return TrackerState.merge_all(states).compute()

    return step, totals


def take_with_window(tracker: Tracker) -> tuple[Callable[[], None], Callable[[], float]]:
    """Steps taken with ``Window.step()`` (a report every 3 steps); the totals over the
    reports."""
    window = Window(tracker, every=3)
    reports: list[dict[str, float]] = []

    def step() -> None:
        report = window.step()
        if report is not None:
            reports.append(report)

    def totals() -> dict[str, float]:
        step()
        reports.append(window.flush())
        names = {name for report in reports for name in report}
        return {name: sum(report.get(name, 0.0) for report in reports) for name in names}

    return step, totals


def take_with_ray(tracker: Tracker) -> tuple[Callable[[], None], Callable[[], float]]:
    """Steps taken with ``rlmetrics.integrations.ray.with_metrics`` (a worker's return; Ray is not
    started: the function runs in the worker's process); the driver's merge."""
    ray = pytest.importorskip("rlmetrics.integrations.ray", exc_type=ImportError)
    states: list[TrackerState] = []

    def step() -> None:
        result, state = ray.with_metrics("result", tracker)
        assert result == "result"
        states.append(state)

    def totals() -> dict[str, float]:
        step()
        return ray.compute_states(states)

    return step, totals


TAKERS = {"Tracker.take_state": take_with_tracker, "Window.step": take_with_window}
TAKERS["ray.with_metrics"] = take_with_ray


def log_while_taking_steps(log: Callable[[int], None], calls: int, step: Callable[[], None]) -> int:
    """One thread makes ``calls`` calls ``log(j)`` once steps are being taken; another
    takes steps (``step()``) until it is done. Returns the number of steps taken."""
    started, done = threading.Event(), threading.Event()
    num_steps = 0

    def logs() -> None:
        started.wait()
        try:
            for j in range(calls):
                log(j)
        finally:
            done.set()

    def take() -> None:
        nonlocal num_steps
        try:
            while not done.is_set():
                step()
                num_steps += 1
                started.set()
        finally:
            started.set()  # a step that raised: the logger still runs, and the error shows

    with tiny_switch_interval():
        run_threads(logs, take)
    return num_steps


@pytest.mark.parametrize("taker", list(TAKERS))
def test_steps_taken_while_a_thread_logs_lose_no_call(taker: str) -> None:
    """A thread logs ``CALLS`` calls while another takes steps as fast as it can: the
    steps together hold every call exactly once (count and value sum). Several rounds,
    since a call is lost only when a thread switch falls between two calls."""
    for round_ in range(ROUNDS):
        tracker = Tracker()
        step, totals = TAKERS[taker](tracker)

        def log(j: int, tracker: Tracker = tracker) -> None:
            tracker.sum("calls", 1.0)
            tracker.sum("values", float(j))

        num_steps = log_while_taking_steps(log, CALLS, step)
        got = totals()
        assert num_steps > 10  # steps were taken while the thread logged
        assert got == {"calls": float(CALLS), "values": float(np.arange(CALLS).sum())}, round_


class DoneEvent:
    """A device event that has completed (no GPU here): every timer of it takes 1 s."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: DoneEvent) -> float:
        return 1000.0


def take_with_window_at_the_end(tracker: Tracker) -> tuple[Callable[[], None], Callable[[], dict]]:
    """Steps taken with ``Window.step()`` into one window (``every=None``), reported by
    one ``flush()`` at the end: the merge of every step, as one step over its calls."""
    window = Window(tracker, every=None)
    return window.step, lambda: (window.step(), window.flush())[1]


DEVICE_TAKERS = {
    "Tracker.take_state": take_with_tracker,
    "Window.step": take_with_window_at_the_end,
}
DEVICE_CALLS = 4_000


def _log_device_entry(tracker: Tracker, entry: str, j: int) -> None:
    """A throughput call with a tensor token count, or a device timer of 1 s."""
    if entry == "tensor token count":
        tracker.throughput("tokens", torch.tensor(float(j)), 1.0)
    else:
        with tracker.timer("gen", events=DoneEvent):
            pass


@pytest.mark.parametrize("taker", list(DEVICE_TAKERS))
@pytest.mark.parametrize("entry", ["tensor token count", "device timer"])
def test_device_timers_and_tensor_counts_added_while_steps_are_taken_lose_none(
    entry: str, taker: str
) -> None:
    """``throughput()`` with a tensor token count and ``timer(device=...)`` keep their
    entry until the fold reads it; a thread adds 4,000 of them while another takes
    steps: the steps together hold every one, as one step over all of them reports (they
    were added outside the tracker's lock, so one added while a step ended landed in
    the list the step's reset then cleared: 2,984 of 20,000 reached a step)."""
    whole = Tracker()
    for j in range(DEVICE_CALLS):
        _log_device_entry(whole, entry, j)
    tracker = Tracker()
    step, totals = DEVICE_TAKERS[taker](tracker)
    num_steps = log_while_taking_steps(
        lambda j: _log_device_entry(tracker, entry, j), DEVICE_CALLS, step
    )
    assert num_steps >= 3  # steps were taken while the thread logged (a few, under load)
    assert totals() == whole.compute()


def test_take_state_raising_resets_nothing_and_the_next_take_returns_the_rest() -> None:
    """A rejected tensor call makes ``take_state()`` raise as ``state()`` does: nothing
    is reset, and the next one returns everything else and starts the next step."""
    torch = pytest.importorskip("torch")
    tracker = Tracker()
    tracker.mean("m", [1.0, 3.0])
    tracker.mean("bad", torch.tensor([1.0]), weight=torch.tensor([-1.0]))
    with pytest.raises(ValueError, match="'bad'"):
        tracker.take_state()
    assert tracker.take_state().compute() == {"m": 2.0}
    assert len(tracker) == 0 and tracker.compute() == {}


def test_a_window_step_with_a_kind_change_takes_the_rest_of_the_step() -> None:
    """A kind change inside a window drops that metric from the step, named at the
    report; the step's other metrics are in the window, and nothing of the step stays
    in the tracker to land in the next one (``step()`` raised and left the whole step
    there, so the recovery merged it into a later step)."""
    tracker = Tracker()
    window = Window(tracker, every=3)
    tracker.mean("x", 1.0)
    window.step()
    tracker.max("x", 4.0)
    tracker.dist("d", [1.0, 2.0])
    assert window.step() is None
    assert tracker.compute() == {}
    with pytest.raises(ValueError, match=r"metric 'x' is kind 'max'"):
        window.flush()
    same = Tracker()  # the window's calls without the dropped one
    same.mean("x", 1.0)
    same.dist("d", [1.0, 2.0])
    assert window.flush() == same.compute()


# -- a grouped call: whole in one step --------------------------------------------------
GROUP_CALLS = 3_000
GROUP = [("g/a", "sum"), ("g/b", "sum"), ("g/c", "sum"), ("g/d", "sum")]


def grouped_log_shared(tracker: Tracker) -> None:
    tracker.log_shared(GROUP, 1.0)


def grouped_prefixed(tracker: Tracker) -> None:
    tracker.prefixed("g/").log_shared([(name[2:], kind) for name, kind in GROUP], [1.0])


def grouped_log_updates(tracker: Tracker) -> None:
    """Two groups of updates (the value objects differ), so two log_shared calls,
    through a prefixed view."""
    one, other = [1.0], [1.0]
    updates = [MetricUpdate(name[2:], kind, one if i < 2 else other) for i, (name, kind) in
               enumerate(GROUP)]  # fmt: skip
    log_updates(tracker.prefixed("g/"), updates)


GROUPED = {
    "log_shared": grouped_log_shared,
    "prefixed log_shared": grouped_prefixed,
    "rl.log_updates": grouped_log_updates,
}


@pytest.mark.parametrize("call", list(GROUPED))
def test_a_grouped_call_lands_whole_in_one_step(call: str) -> None:
    """A thread repeats one call that logs 1 into four metrics while another computes
    steps: every step holds the four with equal counts, and the steps hold them all."""
    names = [name for name, _ in GROUP]
    for round_ in range(ROUNDS):
        tracker = Tracker()
        steps: list[dict[str, float]] = []

        def log(j: int, tracker: Tracker = tracker) -> None:
            GROUPED[call](tracker)

        def step(tracker: Tracker = tracker, steps: list = steps) -> None:
            steps.append(tracker.compute())

        num_steps = log_while_taking_steps(log, GROUP_CALLS, step)
        steps.append(tracker.compute())
        assert num_steps > 10
        split = [step for step in steps if len({step.get(name, 0.0) for name in names}) > 1]
        assert not split, (round_, f"{len(split)} of {len(steps)} steps split a call", split)
        assert sum(step.get("g/a", 0.0) for step in steps) == GROUP_CALLS
