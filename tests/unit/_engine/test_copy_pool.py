"""The log calls' copies of CPU tensors (``rlmetrics._engine.record.CopyPool``) are
written over at the next step instead of freed and allocated again. What each step
reports is still numpy over its own calls, at the values they had when logged: a copy
is reused only once no record holds it (after a fold, early ones included, or a reset),
and only the last step's copies are kept."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmetrics import Tracker


def masked(seed: int, sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen), torch.rand(n, generator=gen) > 0.4) for n in sizes]


def truth(calls: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """numpy's masked mean and max over the calls' values as logged."""
    x = np.concatenate([v.numpy().astype(np.float64) for v, _ in calls])
    kept = x[np.concatenate([m.numpy() for _, m in calls])]
    return kept.mean(), kept.max()


def copies(t: Tracker) -> list[torch.Tensor]:
    """The copies the tracker keeps for its next step."""
    return [c for free in t._plan.copies._free.values() for c in free]


@settings(max_examples=25, deadline=None)
@given(
    steps=st.lists(
        st.lists(st.sampled_from([1, 7, 64, 500]), min_size=1, max_size=6), min_size=2, max_size=4
    ),
    limit=st.sampled_from([100, 600, 1 << 22]),
    seed=st.integers(0, 100),
)
def test_each_step_reports_numpy_over_its_calls_as_logged(
    steps: list[list[int]], limit: int, seed: int
) -> None:
    """Steps of repeated and new shapes, folded early or not, each input changed in
    place right after its call: every step reports its own calls' values."""
    t = Tracker()
    t.record_limit = limit
    for index, sizes in enumerate(steps):
        calls = masked(seed + index, sizes)
        logged = [(v.clone(), m.clone()) for v, m in calls]
        for value, mask in calls:
            t.mean("mean", value, weight=mask)
            t.max("max", value, weight=mask)
            value.add_(100.0)  # after the call: not what was logged
            mask.logical_not_()
        got = t.compute(sync=False)
        if not any(bool(m.any()) for _, m in logged):
            continue  # nothing selected: omitted
        mean, top = truth(logged)
        assert got["mean"] == pytest.approx(mean, rel=1e-12, abs=1e-12)
        assert got["max"] == top


def test_the_next_step_copies_into_the_last_steps_copies() -> None:
    t = Tracker()
    for value, mask in masked(0, [300, 300]):
        t.mean("m", value, weight=mask)
    t.compute(sync=False)
    kept = copies(t)
    assert len(kept) == 4  # two values and two masks
    calls = masked(1, [300, 300])
    for value, mask in calls:
        t.mean("m", value, weight=mask)
    recorded = [*t._accumulators["m"].values, *t._accumulators["m"].weights]
    assert {id(c) for c in recorded} == {id(c) for c in kept}
    assert t.compute(sync=False)["m"] == pytest.approx(truth(calls)[0], rel=1e-12)


def test_only_the_last_steps_copies_are_kept() -> None:
    """Shapes that change every step (sequence lengths) do not pile up copies."""
    t = Tracker()
    for step in range(5):
        for value, mask in masked(step, [10 + step, 20 + step]):
            t.mean("m", value, weight=mask)
        t.compute(sync=False)
        assert sorted(c.numel() for c in copies(t)) == [10 + step] * 2 + [20 + step] * 2


def test_a_reset_gives_back_the_copies_and_the_next_step_is_its_own() -> None:
    t = Tracker()
    for value, mask in masked(0, [50, 50]):
        t.mean("m", value, weight=mask)
    t.reset()  # the step dropped without a fold
    assert len(copies(t)) == 4
    calls = masked(1, [50])
    for value, mask in calls:
        t.mean("m", value, weight=mask)
    assert t.compute(sync=False)["m"] == pytest.approx(truth(calls)[0], rel=1e-12)


def test_calls_by_label_and_copies_by_reference_take_no_copy_from_the_pool() -> None:
    """A call with ``by=`` waits for the fold as a prepared call (a clone of its own),
    and ``copy_cpu_tensors=False`` records the tensor itself."""
    t = Tracker()
    value, labels = torch.arange(6.0), torch.tensor([0, 1, 0, 1, 0, 1])
    t.mean("m", value, by=labels)
    t.copy_cpu_tensors = False
    t.mean("r", value)
    assert t._accumulators["r"].values[0] is value
    assert t.compute(sync=False) == {"m/0": 2.0, "m/1": 3.0, "r": 2.5}
    assert copies(t) == []
