"""Packing reuses one buffer per set of metrics: every step must report that step's
values only, whatever the previous steps packed into it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmetrics import Tracker

from helpers import reference

KINDS = ("mean", "sum", "max", "min", "std", "last", "dist")


def _expected(calls: list[tuple[str, str, np.ndarray]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, kind in sorted({(name, kind) for name, kind, _ in calls}):
        values = [x for n, _, x in calls if n == name]
        out.update(reference(kind, name, np.concatenate(values), None))
    return out


@pytest.mark.parametrize(
    "reduce_host_data_with_numpy", [True, False], ids=["host path", "device path"]
)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_each_step_reports_its_own_values_only(
    reduce_host_data_with_numpy: bool, data: st.DataObject
) -> None:
    """Steps that log the same metrics (one packing, one buffer), some of them not at
    all in a step: each step's compute() and state() equal numpy on that step's values
    (a CPU tensor on the device path adds its rows into the reused host buffer)."""
    tracker = Tracker()
    tracker.reduce_host_data_with_numpy = reduce_host_data_with_numpy
    names = [f"m{i}/{kind}" for i, kind in enumerate(KINDS)]
    for _ in range(4):
        calls = []
        for name, kind in zip(names, KINDS, strict=True):
            for _ in range(data.draw(st.integers(0, 2))):
                size = 1 if kind == "last" else data.draw(st.integers(1, 4))
                x = np.array(
                    data.draw(st.lists(st.integers(-50, 50), min_size=size, max_size=size))
                )
                getattr(tracker, kind)(name, torch.tensor(x, dtype=torch.float64) / 4)
                calls.append((name, kind, x / 4))
        expected = _expected(calls)
        assert tracker.state().compute() == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert tracker.compute() == pytest.approx(expected, rel=1e-12, abs=1e-12)
