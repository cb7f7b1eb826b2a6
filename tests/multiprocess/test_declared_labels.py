"""Declared labels (``rlmetrics.integrations._labels``) on real gloo ranks: a tracker whose
``by=`` calls name every label of a known set reports exactly what it reports without
them, and takes the collectives a tracker without ``by=`` takes, at every step, also at
a step that brings a label no earlier step had.

Each run uses a process group of its own, so each starts with nothing agreed, as a job's
first step does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch.distributed as dist

from rlmetrics import Tracker
from rlmetrics.integrations._labels import DeclaringLabels

from gloo_ranks import count_collectives, ok_results, run_ranks

# per step, each rank's labels (one value per label); "b" first turns up at step 2 (on
# rank 0 only), "c" at step 4, and step 3 holds neither
STEPS = [
    (["a", "a"], ["a"]),
    (["b"], ["a", "a"]),
    (["a"], ["a"]),
    (["c"], ["b", "a"]),
]
LABELS = ("a", "b", "c")


def _values(step: int, rank: int, count: int) -> list[float]:
    return [float(10 * step + 3 * rank + i) for i in range(count)]


def _run(rank: int, mode: str) -> tuple[list[int], list[dict[str, float]]]:
    """Collectives and results per step over a new group: ``mode`` "plain" logs no
    ``by=``; "by" logs by label; "declared" by label through ``DeclaringLabels``."""
    group = dist.new_group([0, 1])
    counts = count_collectives()
    tracker = Tracker()
    log = DeclaringLabels(tracker, LABELS) if mode == "declared" else tracker
    per_step, results = [], []
    for step, labels in enumerate(STEPS):
        mine = labels[rank]
        log.mean("loss", float(step))
        if mode != "plain":
            log.mean("score", _values(step, rank, len(mine)), by=mine)
            log.log_shared([("len/max", "max"), ("len/min", "min")], [1.0] * len(mine), by=mine)
        before = counts["n"]
        results.append(tracker.compute(group=group))
        per_step.append(counts["n"] - before)
    return per_step, results


def _ranks(rank: int, world_size: int) -> dict[str, Any]:
    return {mode: _run(rank, mode) for mode in ("plain", "by", "declared")}


def test_declared_labels_cost_no_collective_and_change_no_value() -> None:
    results = ok_results(run_ranks(_ranks, 2, timeout=180.0))
    for rank, result in enumerate(results):
        plain, by, declared = result["plain"], result["by"], result["declared"]
        assert declared[0] == plain[0] == [3, 1, 1, 1], rank
        assert by[0] == [3, 4, 1, 4], rank  # without declaring: steps 2 and 4 agree again
        assert declared[1] == by[1], rank
        assert declared[1] == results[0]["declared"][1]
    for step, labels in enumerate(STEPS):
        got = results[0]["declared"][1][step]
        present = sorted(set(labels[0]) | set(labels[1]))
        assert sorted(k for k in got if k.startswith("score/")) == [f"score/{x}" for x in present]
        for label in present:
            values = [
                v
                for rank in range(2)
                for v, x in zip(_values(step, rank, len(labels[rank])), labels[rank], strict=True)
                if x == label
            ]
            assert got[f"score/{label}"] == np.mean(values)
