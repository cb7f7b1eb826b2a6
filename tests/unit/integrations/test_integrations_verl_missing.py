"""Without verl installed, the verl integration says what is missing."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.mark.skipif(importlib.util.find_spec("verl") is not None, reason="verl is installed")
def test_importing_the_verl_integration_without_verl_names_the_package() -> None:
    with pytest.raises(ImportError, match=r"needs verl \(tested with 0\.9\.1\): pip install"):
        import rlmetrics.integrations.verl  # noqa: F401
