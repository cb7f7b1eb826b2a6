"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from rlmetrics import Tracker


@pytest.fixture(params=["host", "tensor"])
def log_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test twice: host data (CPU tensors, arrays, lists) accumulated with numpy,
    then through the tensor path that device tensors take (``Tracker.host_arrays``)."""
    monkeypatch.setattr(Tracker, "host_arrays", request.param == "host")
    return request.param


# Modules that spawn processes (gloo ranks, Ray, the trainer): `make test-fast` leaves
# them out with -m "not slow".
SLOW_MODULES = {
    "test_distributed",
    "test_reliability_faults",
    "test_reliability_soak",
    "test_ray",
    "test_resume",
    "test_trainer",
    "test_trainer_ray",
    "test_audit",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
