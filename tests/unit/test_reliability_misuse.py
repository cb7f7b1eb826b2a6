"""Misuse gets a clear error naming the metric or argument; threads may share a tracker.

Inputs the tracker cannot read (ragged lists, sparse, nested and meta tensors), a
state_dict that is not one, bad timeouts, and threads that log and compute at once.
(Groups and timeouts over real ranks: tests/multiprocess/test_distributed_caches.py.)
"""

from __future__ import annotations

import math
import pickle
import re
import threading
from datetime import timedelta

import pytest
import torch

from rlmetrics import Tracker
from rlmetrics.kinds import get_kind

from helpers import tiny_switch_interval

UNREADABLE = ["ragged list", "numbers and lists", "sparse coo", "sparse csr", "nested", "jagged"]
UNREADABLE.append("meta")


def unreadable_inputs() -> dict[str, tuple[object, type, str]]:
    """label -> (value, error type, message part)."""
    dense = "must be a dense tensor with data"
    two_by_two = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    return {
        "ragged list": ([[1.0, 2.0], [3.0]], ValueError, "is a ragged sequence"),
        "numbers and lists": ([1.0, [2.0, 3.0]], ValueError, "is a ragged sequence"),
        "sparse coo": (two_by_two.to_sparse(), TypeError, f"{dense}, got a torch.sparse_coo"),
        "sparse csr": (two_by_two.to_sparse_csr(), TypeError, f"{dense}, got a torch.sparse_csr"),
        "nested": (
            torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
            TypeError,
            f"{dense}, got a nested tensor",
        ),
        "jagged": (
            torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
            TypeError,
            f"{dense}, got a nested tensor",
        ),
        "meta": (torch.ones(3, device="meta"), TypeError, f"{dense}, got a meta tensor"),
    }


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch: sparse CSR and nested are beta
@pytest.mark.parametrize("label", UNREADABLE)
@pytest.mark.parametrize("role", ["value", "weight"])
@pytest.mark.parametrize("kind", ["mean", "sum", "dist"])
def test_unreadable_inputs_are_rejected_in_the_call_naming_the_metric(
    log_path: str, label: str, role: str, kind: str
) -> None:
    """The call raises (naming the metric and the argument), nothing is recorded, and
    the tracker's other metrics still compute."""
    bad, error, message = unreadable_inputs()[label]
    tracker = Tracker()
    tracker.log("good", 2.0, kind="mean")
    args = (bad, None) if role == "value" else (torch.ones(3), bad)
    with pytest.raises(error, match=re.escape(f"metric 'bad/{kind}': {role} {message}")):
        tracker.log(f"bad/{kind}", *args, kind=kind)
    assert f"bad/{kind}" not in tracker
    assert tracker.compute(sync=False) == {"good": 2.0}


@pytest.mark.parametrize("state_dict", [None, [("x", 1.0)], "state"])
def test_load_state_dict_of_a_non_dict_is_a_type_error_naming_the_argument(
    state_dict: object,
) -> None:
    tracker = Tracker()
    tracker.mean("x", 1.0)
    with pytest.raises(TypeError, match=r"load_state_dict\(state_dict\): expected the dict"):
        tracker.load_state_dict(state_dict)
    assert tracker.compute() == {"x": 1.0}  # nothing changed


@pytest.mark.parametrize(
    ("timeout", "error", "message"),
    [
        (0, ValueError, "timeout must be > 0 seconds"),
        (-1.0, ValueError, "timeout must be > 0 seconds"),
        (math.nan, ValueError, "timeout must be > 0 seconds"),
        (-math.inf, ValueError, "timeout must be > 0 seconds"),
        (timedelta(seconds=-1), ValueError, "timeout must be > 0 seconds"),
        ("30", TypeError, "timeout must be seconds"),
        (True, TypeError, "timeout must be seconds"),
    ],
)
def test_bad_timeouts_are_rejected_even_without_a_group(
    timeout: object, error: type, message: str
) -> None:
    """A bad timeout is a bug in the caller: it raises in a one-process run too, before
    a multi-rank run would meet it, and the step is kept."""
    tracker = Tracker()
    tracker.mean("x", 1.0)
    with pytest.raises(error, match=message):
        tracker.compute(timeout=timeout)
    assert tracker.compute(timeout=math.inf) == {"x": 1.0}


def test_an_unpickled_tracker_logs_into_this_process_kinds() -> None:
    """Pickling copies the kind objects; unpickling puts every metric back on this
    process's kinds (the ones an agreed layout holds) and gives a new lock."""
    tracker = Tracker()
    tracker.mean("m", 1.0)
    tracker.dist("d", [1.0, 2.0])
    copy = pickle.loads(pickle.dumps(tracker))
    assert copy._metric_records["m"].kind is get_kind("mean")
    assert copy._metric_records["d"].kind is copy.kind("dist")
    assert copy._lock is not tracker._lock
    copy.mean("m", 3.0)
    assert copy.compute()["m"] == 2.0


THREADS, CALLS = 4, 3000


def test_threads_logging_and_computing_lose_nothing() -> None:
    """Four threads log into one tracker while a fifth computes steps: every call lands
    whole in exactly one step. The switch interval is made tiny so that threads
    interleave inside calls (without the lock, values are lost and compute() raises
    "dictionary changed size during iteration")."""
    tracker = Tracker()
    steps: list[dict[str, float]] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def log(index: int) -> None:
        try:
            for j in range(CALLS):
                tracker.sum("calls", 1.0)
                tracker.sum("values", float(j))
                tracker.max(f"thread{index}/{j % 50}", float(j))  # names appear and vanish
                if j % 100 == 0:
                    tracker.sum("tensor", torch.ones(3))
        except BaseException as error:
            errors.append(error)

    def compute() -> None:
        try:
            while not done.is_set():
                steps.append(tracker.compute(sync=False))
        except BaseException as error:
            errors.append(error)

    with tiny_switch_interval():
        computer = threading.Thread(target=compute)
        loggers = [threading.Thread(target=log, args=(i,)) for i in range(THREADS)]
        for thread in (computer, *loggers):
            thread.start()
        for thread in loggers:
            thread.join()
        done.set()
        computer.join()
    assert not errors, errors
    steps.append(tracker.compute(sync=False))
    assert len(steps) > 2  # compute() did run while threads logged

    def total(name: str) -> float:
        return sum(step.get(name, 0.0) for step in steps)

    assert total("calls") == THREADS * CALLS
    assert total("values") == THREADS * sum(range(CALLS))
    assert total("tensor") == THREADS * (CALLS // 100) * 3
    for index in range(THREADS):
        highs = [step.get(f"thread{index}/49", -math.inf) for step in steps]
        assert max(highs) == CALLS - 1
