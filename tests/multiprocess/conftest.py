"""Every test in this folder spawns processes (gloo ranks, Ray, trainer runs), so every
one is marked slow here, by folder: `make test-fast` (``-m "not slow"``) leaves them out and
`make test-slow` (``-m slow``) runs them. A spawning test in another folder, beside fast
tests that share its fixtures, carries ``@pytest.mark.slow`` itself."""

from __future__ import annotations

from pathlib import Path

import pytest

FOLDER = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(FOLDER):
            item.add_marker(pytest.mark.slow)
