"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from rlmetrics import Tracker


@pytest.fixture(params=["host", "tensor"])
def log_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test twice: host data (CPU tensors, arrays, lists) accumulated with numpy,
    then through the tensor path that device tensors take
    (``Tracker.reduce_host_data_with_numpy``)."""
    monkeypatch.setattr(Tracker, "reduce_host_data_with_numpy", request.param == "host")
    return request.param


@pytest.fixture
def cpu_tensors_by_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors recorded by reference, as device tensors are (``Tracker.copy_cpu_tensors``
    False): the checks a device tensor gets (its version counter at the fold), run on the
    CPU."""
    monkeypatch.setattr(Tracker, "copy_cpu_tensors", False)
