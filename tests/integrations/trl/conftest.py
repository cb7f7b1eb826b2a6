"""The TRL suite runs in .venv-trl. pytest puts tests/ on sys.path (for the core suite's
helpers), where tests/multiprocess.py would shadow the ``multiprocess`` package that
``datasets`` imports: import the real one first, with tests/ out of the path."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[2]
_saved = list(sys.path)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _TESTS]
try:
    import multiprocess.pool  # noqa: F401
except ImportError:  # not in .venv-trl: the suite skips itself (importorskip)
    pass
finally:
    sys.path[:] = _saved
