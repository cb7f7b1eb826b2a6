"""The one owner of a tracker's caches (``rlmetrics._engine.plan.StepPlan``)."""

from __future__ import annotations

import copy
import pickle

import torch

from rlmetrics import Tracker


def _step(tracker: Tracker) -> dict[str, float]:
    tracker.mean("a", 1.0)
    tracker.sum("b", torch.tensor([1.0, 2.0]))
    return tracker.compute(sync=False)


def test_a_steady_step_reuses_the_plans_and_the_packing() -> None:
    tracker = Tracker()
    _step(tracker)
    plan = tracker._plan
    folds, local = dict(plan._folds), plan._local
    assert _step(tracker) == {"a": 1.0, "b": 3.0}
    assert plan._local is local
    assert all(plan._folds[device][1] is folds[device][1] for device in folds)


def test_other_metrics_or_renumbered_rows_make_new_entries() -> None:
    tracker = Tracker()
    _step(tracker)
    local = tracker._plan._local
    tracker.mean("c", 2.0)
    assert tracker.compute(sync=False) == {"c": 2.0}
    assert tracker._plan._local is not local
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
        assert other._plan._local is None and not other._plan._folds
        assert other.compute(sync=False) == {"a": 3.0}
