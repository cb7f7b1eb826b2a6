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


# `make test` runs the core suite in two parts: `-m "not slow"` (`make test-fast`, the
# inner loop) and `-m slow` (`make test-slow`). Slow: whatever spawns processes (gloo
# ranks, Ray, trainer runs). Whole modules are listed here; other modules mark their
# spawning tests with @pytest.mark.slow, or are listed in SLOW_TESTS.
SLOW_MODULES = {
    "test_distributed",
    "test_distributed_caches",
    "test_reliability_faults",
    "test_reliability_soak",
    "test_ray",
    "test_resume",
    "test_trainer",
    "test_trainer_ray",
}
SLOW_TESTS = {  # module: test functions that spawn gloo ranks
    "test_custom_kinds": {
        "test_custom_kinds_merge_identically_through_container_ray_and_gloo",
        "test_one_kind_configured_two_ways_across_ranks_raises_on_every_rank",
    },
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is None:
            continue
        module = item.module.__name__.rsplit(".", 1)[-1]
        name = getattr(item, "originalname", item.name)
        if module in SLOW_MODULES or name in SLOW_TESTS.get(module, ()):
            item.add_marker(pytest.mark.slow)
