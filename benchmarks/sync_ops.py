"""The torch ops one ``compute()`` dispatches after few or many log calls (sync_bench).

Issue 18's target: the count is the same whatever the number of log calls in the step
(the step's records are reduced in a fixed number of vectorised ops). Each rank of a
``sync_bench.py`` world logs ``calls`` 0-d float32 tensors into ``NUM_METRICS`` metrics
(kinds in turn, values shared by the ranks so that ``last`` metrics agree), then runs
one ``compute()`` under ``op_count.OpCounter``: the collective is counted when it goes
through torch's dispatcher. One untimed step first agrees the schema, as a training
run's first step does. Both paths are counted: the host path (CPU tensors, the
tracker's default) and the tensor path (``reduce_host_data_with_numpy = False``, what a CUDA tensor
takes). Only the public API is used.
"""

from __future__ import annotations

import numpy as np
import torch

from rlmetrics import Tracker

from op_count import count_ops, describe
from sync_contenders import KINDS

CALLS = (100, 10_000)
NUM_METRICS = 8
PATHS = ("host path", "tensor path")
Counts = dict[tuple[str, int], tuple[int, str]]  # (path, calls) -> (ops, ops by name)


def compute_ops(calls: int, path: str) -> tuple[int, str]:
    """(ops, ops by name) of one steady-state ``compute()`` after ``calls`` log calls."""
    tracker = Tracker()
    if path == "tensor path":
        if not hasattr(Tracker, "reduce_host_data_with_numpy"):  # setting it would pass silently
            raise RuntimeError(
                "Tracker.reduce_host_data_with_numpy is gone: the tensor path needs a switch"
            )
        tracker.reduce_host_data_with_numpy = False
    names = [f"ops/{i}" for i in range(NUM_METRICS)]
    logs = [getattr(tracker, KINDS[i % len(KINDS)]) for i in range(NUM_METRICS)]
    rng = np.random.default_rng(0)  # the same values on every rank
    values = [torch.tensor(v, dtype=torch.float32) for v in rng.normal(1.0, 0.5, 97)]

    def log(num_calls: int) -> None:
        for i in range(num_calls):
            logs[i % NUM_METRICS](names[i % NUM_METRICS], values[i % len(values)])

    log(NUM_METRICS)
    tracker.compute()  # the first step agrees the schema
    log(calls)
    counter = count_ops(tracker.compute)
    return counter.total, describe(counter)


def measure() -> Counts:
    """Every (path, calls) pair; every rank of the world must call it."""
    return {(path, calls): compute_ops(calls, path) for path in PATHS for calls in CALLS}


def markdown(by_world: dict[int, Counts]) -> list[str]:
    """The table (ops per compute() by number of log calls) and the ops by name."""
    rows = [
        "| ranks | log calls take | "
        + " | ".join(f"ops after {c:,} calls" for c in CALLS)
        + " | same count |",
        "|---:|---|" + "---:|" * len(CALLS) + "---|",
    ]
    for world, counts in by_world.items():
        for path in PATHS:
            totals = [counts[path, calls][0] for calls in CALLS]
            same = "yes" if len(set(totals)) == 1 else "no"
            rows.append(f"| {world} | {path} | " + " | ".join(map(str, totals)) + f" | {same} |")
    rows.append("")
    world, counts = next(iter(by_world.items()))
    rows.extend(
        f"- {world} ranks, {path}, {calls:,} calls: {counts[path, calls][1]}"
        for path in PATHS
        for calls in CALLS
    )
    return rows


def verdict(by_world: dict[int, Counts]) -> str:
    """Met when every (ranks, path) row has the same count for every number of calls."""
    same = all(
        len({counts[path, calls][0] for calls in CALLS}) == 1
        for counts in by_world.values()
        for path in PATHS
    )
    return (
        f"Target: the same number of torch ops in compute() after {CALLS[0]:,} and "
        f"{CALLS[-1]:,} log calls, on both paths: {'met' if same else 'not met'}."
    )
