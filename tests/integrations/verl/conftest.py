"""The verl suite runs in .venv-verl (``make test-verl``); elsewhere it is skipped whole.

Real verl 0.9.1 runs on the CPU here (``cpu_verl.py``); the spawned ranks share one
temporary HOME/TMPDIR, so nothing is written outside it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator

import pytest

if importlib.util.find_spec("verl") is None:  # the core venv: nothing here can run
    collect_ignore_glob = ["test_*.py"]

# tests/multiprocess.py (on sys.path through tests/conftest.py) shadows the
# ``multiprocess`` package that verl imports (through ``datasets``): put the tests folder
# last, so site-packages wins, here and in spawned ranks (they inherit sys.path).
_TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _TESTS in sys.path:
    sys.path.remove(_TESTS)
    sys.path.append(_TESTS)
_shadow = sys.modules.get("multiprocess")
if _shadow is not None and not hasattr(_shadow, "__path__"):
    del sys.modules["multiprocess"]


@pytest.fixture(scope="session")
def verl_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A temporary HOME and TMPDIR for verl, transformers and torch (and their caches)."""
    home = str(tmp_path_factory.mktemp("verl_home"))
    saved = {key: os.environ.get(key) for key in ("HOME", "TMPDIR", "HF_HOME")}
    os.environ.update(HOME=home, TMPDIR=home, HF_HOME=os.path.join(home, "hf"))
    try:
        yield home
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def model_path(verl_home: str) -> str:
    """The tiny actor and critic models, saved once per session."""
    from scenarios import make_models

    path = os.path.join(verl_home, "models")
    make_models(path)
    return path
