"""Declared labels: a per-label metric's name on every rank at every step, with or without
a sample of that label, so that the names a step logs never depend on which labels the
step's data happens to hold.

Why: ranks agree on the set of names when a step logs a name that the layout agreed
over the process group lacks (``docs/distributed.md``, "Schema agreement": two small
byte gathers, then the step's reduce again). A label that turns up for the first time
at a later step (a data source absent from the first batches), or again after the
layout was agreed without it, would cost that agreement at that step. Declaring every
label of a known set at every step puts all of them in the first step's agreement,
which every process group has anyway, and keeps them there: the collectives per step
are then the same as without per-label metrics, from the first step on.

A declared name is logged as an empty call (no element): it is part of the step's
schema on every rank, and a label no rank held a sample of this step is left out of
``compute()``'s result (``Tracker(empty="omit")``, the default), exactly as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from rlmetrics.tracker import LogTarget, Tracker

NO_ELEMENTS: list[float] = []
"""The value of a declaring call: no element, so nothing is recorded but the name."""


def declare(log: LogTarget, metrics: Iterable[tuple[str, str]], labels: Sequence[str]) -> None:
    """Log ``name/<label>`` for every (name, kind) of ``metrics`` and every label, with
    no element (one ``log_shared`` call)."""
    named = [(f"{name}/{label}", kind) for name, kind in metrics for label in labels]
    if named:
        log.log_shared(named, NO_ELEMENTS)


class DeclaringLabels(LogTarget):
    """A view of a tracker whose calls with ``by=`` also declare every label of
    ``labels`` (``declare``): the names such a call makes are then the same on every
    rank, whichever labels its data holds. Other calls pass through unchanged.

    ``by=`` labels must name their metrics as themselves (strings, no ``labels=``
    mapping), as the declared names are ``name/<label>``.
    """

    def __init__(self, tracker: Tracker, labels: Iterable[str]) -> None:
        self.tracker = tracker
        self.labels = tuple(sorted(set(labels)))
        self.device_timers = tracker.device_timers

    def _log(self, name: str, kind: str, value: Any, weight: Any, by: Any, labels: Any) -> None:
        if by is None:
            self.tracker._log(name, kind, value, weight, by, labels)
            return
        with self.tracker._holding():
            declare(self.tracker, [(name, kind)], self.labels)
            self.tracker._log(name, kind, value, weight, by, labels)

    def _log_shared(self, metrics: list[tuple[str, str]], value: Any, weight: Any) -> None:
        self.tracker._log_shared(metrics, value, weight)

    def _holding(self) -> AbstractContextManager[Any]:
        return self.tracker._holding()

    def _log_by(
        self, metrics: list[tuple[str, str]], value: Any, weight: Any, by: Any, labels: Any
    ) -> None:
        with self.tracker._holding():
            declare(self.tracker, metrics, self.labels)
            self.tracker._log_by(metrics, value, weight, by, labels)
