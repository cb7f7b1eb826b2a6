"""The Logger protocol and the failure policy every backend shares.

A logger receives one ``dict[str, float]`` per step. Writing must never stop training:
a backend that fails to write warns once per kind of failure, with the exception in the
message, and carries on. It counts the failures it does not report one by one, and says
how many at ``close()``. Missing optional libraries are different: they raise
``ImportError`` at construction, naming the extra to install.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol, TypeGuard, runtime_checkable


class LoggerWarning(RuntimeWarning):
    """A logging backend failed; training continues."""


@runtime_checkable
class Logger(Protocol):
    """What the trainer calls on every backend.

    Backends whose position in the run matters (a JSONL file, an MLflow run) also have
    ``state_dict()`` and ``load_state_dict(state)``; see ``has_state``.
    """

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Write one step's metrics."""
        ...

    def close(self) -> None:
        """Flush and release the backend."""
        ...


class StatefulLogger(Logger, Protocol):
    """A backend that checkpoints its position in the run (see ``has_state``)."""

    def state_dict(self) -> dict[str, Any]:
        """The backend's position, to save with the trainer's checkpoint."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a ``state_dict()``."""
        ...


def has_state(logger: object) -> TypeGuard[StatefulLogger]:
    """Whether ``logger`` checkpoints its position (``state_dict``/``load_state_dict``)."""
    return callable(getattr(logger, "state_dict", None)) and callable(
        getattr(logger, "load_state_dict", None)
    )


def missing_extra(backend: str, module: str, extra: str, error: ImportError) -> ImportError:
    """The ImportError raised when a backend's library is not installed."""
    message = (
        f"the {backend} logger needs the {module!r} package, which could not be imported "
        f"({error}); install it with: pip install 'rlmetrics[{extra}]'"
    )
    exc = ImportError(message, name=module)
    exc.__cause__ = error
    return exc


class FailureReporter:
    """Warns once per (operation, exception type): the policy "never stop training".

    The failures after the first of each kind are counted; ``report_dropped`` (each
    backend's ``close()``) says how many there were.
    """

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._failures: dict[tuple[str, type[BaseException]], int] = {}  # per kind

    @contextmanager
    def guard(self, operation: str) -> Iterator[None]:
        """Run a backend call; an exception becomes a (first-time) warning."""
        try:
            yield
        except Exception as exc:  # a logger must never stop training
            self.report(operation, exc)

    def report(self, operation: str, exc: Exception) -> None:
        """Warn about ``exc`` unless this kind of failure was already reported; count it."""
        key = (operation, type(exc))
        count = self._failures.get(key, 0)
        self._failures[key] = count + 1
        if count:
            return
        cause = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        warnings.warn(
            f"rlmetrics: the {self.backend} logger failed to {operation}: {cause}. "
            "Training continues; further failures of this kind are counted, and their "
            "number is reported when the logger closes.",
            LoggerWarning,
            stacklevel=4,
        )

    def report_dropped(self) -> None:
        """Warn how many failures were not reported one by one, if any (once each)."""
        dropped = [(key, count - 1) for key, count in self._failures.items() if count > 1]
        if not dropped:
            return
        for key, _ in dropped:
            self._failures[key] = 1
        counts = ", ".join(
            f"{count} more to {operation} ({error.__name__})"
            for (operation, error), count in dropped
        )
        warnings.warn(
            f"rlmetrics: the {self.backend} logger failed {counts} after the first failure "
            "of each kind, which was reported.",
            LoggerWarning,
            stacklevel=3,
        )


def as_float(value: Any) -> float:
    """A metric value as a python float (numbers, numpy scalars, 0-d tensors)."""
    if isinstance(value, float):
        return value
    item = getattr(value, "item", None)
    return float(item() if callable(item) else value)
