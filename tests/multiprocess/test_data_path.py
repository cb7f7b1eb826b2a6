"""The data path docs/architecture.md walks through: a masked ``mean`` call and a
steady-state ``compute()`` on 2 gloo ranks enter the modules of rlmetrics that walk
names, no other, in its order of first entry."""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch

from rlmetrics import Tracker

from gloo_ranks import run_ranks

# docs/architecture.md, "The walk of one step": the modules in the order first entered
WALK = (
    "rlmetrics.tracker",
    "rlmetrics._engine.record",
    "rlmetrics._engine.copies",
    "rlmetrics._engine.sync",
    "rlmetrics._engine.fold",
    "rlmetrics._engine.plan",
    "rlmetrics._engine.assemble",
    "rlmetrics._engine.host_batch",
    "rlmetrics.kinds.base",
    "rlmetrics.kinds.batch",
    "rlmetrics._engine.table",
    "rlmetrics._engine.packing",
    "rlmetrics.kinds.mean",
)


def _modules_entered(call: Any) -> list[str]:
    """The rlmetrics modules whose functions ``call()`` enters, in first-entry order."""
    entered: list[str] = []

    def tracer(frame: FrameType, event: str, arg: Any) -> None:
        module = frame.f_globals.get("__name__", "")
        if event == "call" and module.startswith("rlmetrics") and module not in entered:
            entered.append(module)

    sys.settrace(tracer)  # type: ignore[arg-type]
    try:
        call()
    finally:
        sys.settrace(None)
    return entered


def _walk(rank: int, world: int) -> tuple[list[str], list[str], dict[str, float]]:
    tracker = Tracker()
    values = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    mask = torch.arange(1000) % 3 != rank
    for _ in range(3):  # the steady state: the plans and the group's layout are made
        tracker.mean("x", values, weight=mask)
        tracker.compute()
    logged = _modules_entered(lambda: tracker.mean("x", values, weight=mask))
    result: dict[str, float] = {}
    computed = _modules_entered(lambda: result.update(tracker.compute()))
    return logged, computed, result


def test_a_masked_mean_and_a_two_rank_compute_walk_the_documented_modules() -> None:
    outcomes = run_ranks(_walk, 2)
    expected_x = 0.0
    selected = 0
    for rank in range(2):
        values = torch.arange(1000, dtype=torch.float64) * (rank + 1)
        mask = torch.arange(1000) % 3 != rank
        expected_x += float(values[mask].sum())
        selected += int(mask.sum())
    for rank, (status, outcome) in sorted(outcomes.items()):
        assert status == "ok", outcome
        logged, computed, result = outcome
        walk = list(dict.fromkeys(logged + computed))
        assert walk == list(WALK), f"rank {rank}: {walk}"
        assert result["x"] == expected_x / selected
