"""How a window's parts travel through one sync: each metric under a tagged name; and
the states of replacing kinds in a window.

A ``Window`` report syncs one tracker whose metric names say which part of the report
each is: ``w/<name>`` the window's merged state, ``l<a>/<name>`` a replacing metric's
(``last``'s) value as of ``a`` steps before the window's last, ``s<i>/<name>`` step
``i``'s own state (per-step values), ``r/rejected`` the count of steps with rejected
or dropped calls. Every name gets a tag, so a user's name can never be read as another
part. The synced states are sorted out by part (``decode``) before any result is
computed, so results, their checks and warnings see the user's names, never the tags.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from rlmetrics.kinds import Kind, MetricState
from rlmetrics.kinds.base import carries_extra, result_of


def window_key(part: str, name: str) -> str:
    """The reporter's name of ``name`` in the report's ``part``."""
    return f"{part}/{name}"


@dataclass
class Decoded:
    """A report's merged states, sorted out by part, under the user's names.

    Attributes:
        window: the window's state per metric (a replacing kind's: its latest value,
            with the window's non-finite count).
        per_step: one state per step of the window, for the per-step metrics.
        num_rejected: steps (summed over ranks) with rejected or dropped log calls.
    """

    window: dict[str, MetricState] = field(default_factory=dict)
    per_step: list[dict[str, MetricState]] = field(default_factory=list)
    num_rejected: float = 0.0


def decode(states: Mapping[str, MetricState], num_steps: int) -> Decoded:
    """Split a report's merged states (the reporter's, synced) into the window's parts.

    A replacing metric's state is taken from the youngest step any rank sent it for:
    the last step of the window in which it was logged. The states keep the user's
    names, so that their results are computed, checked (two metrics reporting one key)
    and warned about (``last``'s disagreeing ranks) under those names.
    """
    decoded = Decoded(per_step=[{} for _ in range(num_steps)])
    latest: dict[str, tuple[int, MetricState]] = {}  # name -> (youngest age, its state)
    for key, metric in states.items():
        part, name = key.split("/", 1)
        tag, index = part[0], part[1:]
        if tag == "w":
            decoded.window[name] = metric
        elif tag == "l":
            age, seen = int(index), latest.get(name)
            if seen is None or age < seen[0]:
                latest[name] = (age, metric)
        elif tag == "s":
            decoded.per_step[int(index)][name] = metric
        elif tag == "r":
            decoded.num_rejected = metric.sums[0]
    for name, (_, metric) in latest.items():  # the window's count, whatever step it is in
        nonfinite = decoded.window[name].num_nonfinite
        decoded.window[name] = dataclasses.replace(metric, num_nonfinite=nonfinite)
    return decoded


def latest_of(
    old: tuple[int, MetricState] | None, index: int, new: MetricState, kind: Kind, name: str
) -> tuple[int, MetricState]:
    """A replacing metric's latest (step, state): the new step's when it holds a value,
    else the old one; the non-finite counts of both steps add up."""
    nonfinite = new.num_nonfinite + (old[1].num_nonfinite if old else 0.0)
    # -1: no value yet (an empty state, kept for empty="nan")
    keep = (index, new) if has_value(kind, new, name) else old or (-1, new)
    return keep[0], dataclasses.replace(keep[1], num_nonfinite=nonfinite)


def has_value(kind: Kind, state: MetricState, name: str) -> bool:
    """Whether ``state`` reports a value (a ``last`` logged with weight 0 only does not)."""
    return result_of(kind, state, name) is not None


def empty_state(kind: Kind, num_nonfinite: float) -> MetricState:
    """An empty state of ``kind`` carrying a non-finite count."""
    return MetricState(
        kind.name,
        (0.0,) * kind.num_sums,
        (-math.inf,) * kind.num_maxes,
        kind.empty_extra() if carries_extra(kind) else None,
        num_nonfinite,
        kind.fingerprint(),
    )


__all__ = ["Decoded", "decode", "empty_state", "has_value", "latest_of", "window_key"]
