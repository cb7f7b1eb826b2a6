"""Fixtures shared by the test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rlmetrics import Tracker


@pytest.fixture(params=["host", "tensor"])
def log_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test twice: host data (CPU tensors, arrays, lists) accumulated with numpy,
    then through the tensor path that device tensors take (``Tracker.host_arrays``)."""
    saved = Tracker.host_arrays
    Tracker.host_arrays = request.param == "host"
    try:
        yield request.param
    finally:
        Tracker.host_arrays = saved
