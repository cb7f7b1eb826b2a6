"""The public API is frozen: a renamed name or a changed signature fails here until the
snapshot (tests/unit/public_api.txt) is updated with it, so every change is deliberate
and reaches CHANGELOG.md. How the API is read: tests/_support/public_api.py."""

from __future__ import annotations

import pytest

from public_api import COMMAND_LINE, ENTRY_POINTS, FRAMEWORK_MODULES, check, public_modules


def test_public_api_matches_the_snapshot() -> None:
    """Every public module but the verl and TRL ones (their venvs check those), the entry
    points and the command line."""
    modules = public_modules()
    core = [name for name in modules if name not in FRAMEWORK_MODULES]
    every = [*modules, ENTRY_POINTS, COMMAND_LINE]
    diff = check([*core, ENTRY_POINTS, COMMAND_LINE], every_section=every)
    if diff:
        pytest.fail(diff, pytrace=False)


def test_the_framework_modules_are_public_modules() -> None:
    """The modules left to the verl and TRL venvs exist and declare ``__all__``, so no
    public module goes unchecked because its name changed."""
    assert set(FRAMEWORK_MODULES) <= set(public_modules())
