"""Every ``>>>`` example in the package's docstrings runs and prints what it shows.

The API reference renders them (``Examples:`` sections; ``make docs`` fails on one that
renders as a quote, see docs/hooks/no_quotes.py); this test keeps their output true.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
MODULES = sorted(
    ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
    for path in SRC.rglob("*.py")
    if ">>>" in path.read_text()
)


def test_modules_with_examples_are_found() -> None:
    assert "rlmetrics.tracker" in MODULES and len(MODULES) >= 10, MODULES


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples_run(module: str) -> None:
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, result  # rlmetrics.loggers skips its one (it writes files)
