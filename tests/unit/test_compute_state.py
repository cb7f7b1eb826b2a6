"""``Tracker.compute_state``: the step's merged state, from the same sync as ``compute``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlmetrics import Tracker, TrackerState

from gloo_ranks import ok_results, run_ranks
from helpers import log_every_kind

BATCH = {
    "value": np.random.default_rng(0).normal(1e3, 3.0, 24),
    "weight": np.random.default_rng(1).integers(0, 4, 24).astype(np.float64),
    "mask": np.random.default_rng(2).random(24) < 0.7,
}


def two_trackers(rows: np.ndarray) -> tuple[Tracker, Tracker]:
    """Two trackers holding the same calls (every built-in kind) for ``rows``."""
    pair = Tracker(), Tracker()
    for tracker in pair:
        for piece in np.array_split(rows, 3):
            log_every_kind(tracker, BATCH, piece)
    return pair


def test_the_state_computes_to_what_compute_returns_and_the_step_ends() -> None:
    mine, twin = two_trackers(np.arange(24))
    state = mine.compute_state(sync=False)
    assert isinstance(state, TrackerState)
    assert state.compute() == twin.compute(sync=False)
    assert len(mine) == 0  # reset, as compute() resets


def test_reset_false_keeps_the_step() -> None:
    mine, twin = two_trackers(np.arange(24))
    first = mine.compute_state(reset=False, sync=False)
    assert first.compute() == mine.compute_state(sync=False).compute()
    assert first.compute() == twin.compute(sync=False)


def test_a_rejected_call_raises_as_in_compute_and_the_rest_is_kept() -> None:
    tracker = Tracker()
    tracker.mean("good", 2.0)
    tracker.mean("bad", torch.tensor([1.0]), weight=torch.tensor([-1.0]))
    with pytest.raises(ValueError, match="bad"):
        tracker.compute_state(sync=False)
    assert tracker.compute_state(sync=False).compute() == {"good": 2.0}


def synced_on_ranks(rank: int, world: int) -> tuple[TrackerState, dict, dict]:
    """Rank ``rank``'s share: its merged state, that state's values and what
    ``compute()`` returns for the same calls (both synced over the group)."""
    rows = np.array_split(np.arange(24), world)[rank]
    mine, twin = two_trackers(rows)
    state = mine.compute_state()
    return state, state.compute(), twin.compute()


def test_every_rank_gets_the_merged_state_of_compute() -> None:
    outcome = run_ranks(synced_on_ranks, 2, start_method="fork")
    states, values, computed = zip(*ok_results(outcome), strict=True)
    assert states[0].to_dict() == states[1].to_dict()
    assert values[0] == values[1] == computed[0] == computed[1]
    one_process, _ = two_trackers(np.arange(24))
    assert values[0].keys() == one_process.compute(sync=False).keys()
