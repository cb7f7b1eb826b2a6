"""The one owner of a tracker's caches (``rlmetrics._engine.plan.StepPlan``)."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch

from rlmetrics import Tracker
from rlmetrics._engine import plan as plan_module


def _step(tracker: Tracker) -> dict[str, float]:
    tracker.mean("a", 1.0)
    tracker.sum("b", torch.tensor([1.0, 2.0]))
    return tracker.compute(sync=False)


def test_a_steady_step_reuses_the_plans_and_the_packing() -> None:
    tracker = Tracker()
    _step(tracker)
    plan = tracker._plan
    folds = {device: list(recent.entries) for device, recent in plan._folds.items()}
    local = list(plan._local.entries)
    assert _step(tracker) == {"a": 1.0, "b": 3.0}
    assert plan._local.entries == local
    assert all(plan._folds[device].entries == folds[device] for device in folds)


def test_other_metrics_or_renumbered_rows_make_new_entries() -> None:
    tracker = Tracker()
    _step(tracker)
    local = tracker._plan._local.entries[0][1]
    tracker.mean("c", 2.0)
    assert tracker.compute(sync=False) == {"c": 2.0}
    assert tracker._plan._local.entries[0][1] is not local
    for i in range(600):  # names that come and go: the table is compacted
        tracker.mean(f"n{i}", 1.0)
        tracker.compute(sync=False)
    version = tracker._table.version
    assert version > 0
    assert _step(tracker) == {"a": 1.0, "b": 3.0}
    assert tracker._plan._version == version


def test_a_pickled_or_copied_tracker_gets_a_new_empty_plan() -> None:
    tracker = Tracker()
    _step(tracker)
    tracker.mean("a", 3.0)
    for other in (pickle.loads(pickle.dumps(tracker)), copy.deepcopy(tracker), copy.copy(tracker)):
        assert other._plan is not tracker._plan
        assert not other._plan._local.entries and not other._plan._folds
        assert other.compute(sync=False) == {"a": 3.0}


def test_metric_sets_logged_in_turn_each_keep_their_plans_and_packing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A loop that logs two sets of metrics in turn (a step that generates and logs its
    rewards, then one that reuses the samples) makes each set's layout, packing and fold
    plan once; a fifth set evicts the oldest of RECENT_ENTRIES."""
    made = {"layouts": 0, "folds": 0}
    layout_class, fold_class = plan_module.BufferLayout, plan_module.FoldPlan

    def counted(kind: str, cls: type) -> Any:
        def make(*args: Any) -> Any:
            made[kind] += 1
            return cls(*args)

        return make

    monkeypatch.setattr(plan_module, "BufferLayout", counted("layouts", layout_class))
    monkeypatch.setattr(plan_module, "FoldPlan", counted("folds", fold_class))
    tracker = Tracker()
    for step in range(8):
        tracker.mean("a", 1.0)
        tracker.sum("b", torch.tensor([1.0, 2.0]))
        if step % 2 == 0:
            tracker.mean("reward", float(step))
        expected = {"a": 1.0, "b": 3.0} | ({"reward": float(step)} if step % 2 == 0 else {})
        assert tracker.compute(sync=False) == expected
    assert made == {"layouts": 2, "folds": 2}
    for i in range(plan_module.RECENT_ENTRIES):  # as many other sets: the first drops
        tracker.mean(f"other{i}", 1.0)
        tracker.compute(sync=False)
    _step(tracker)
    assert made["layouts"] == 2 + plan_module.RECENT_ENTRIES + 1
