"""The SkyRL integration's public API against the snapshot (tests/unit/test_public_api.py
checks the rest; this venv has SkyRL, the core one does not)."""

from __future__ import annotations

import pytest

from public_api import FRAMEWORK_MODULES, check


def test_skyrl_public_api_matches_the_snapshot() -> None:
    diff = check(name for name, framework in FRAMEWORK_MODULES.items() if framework == "skyrl")
    if diff:
        pytest.fail(diff, pytrace=False)
