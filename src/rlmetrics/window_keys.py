"""How a window's parts travel through one sync: each metric under a tagged name; and
the states of replacing kinds in a window.

A ``Window`` report syncs one tracker whose metric names say which part of the report
each is: ``w/<name>`` the window's merged state, ``l<a>/<name>`` a replacing metric's
(``last``'s) value as of ``a`` steps before the window's last, ``s<i>/<name>`` step
``i``'s own state (per-step values), ``r/rejected`` the count of steps with rejected
calls. Every name gets a tag, so a user's name can never be read as another part.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from rlmetrics.kinds import Kind, MetricState


def window_key(part: str, name: str) -> str:
    """The reporter's name of ``name`` in the report's ``part``."""
    return f"{part}/{name}"


@dataclass
class Decoded:
    """A report's values, sorted out by part.

    Attributes:
        window: the window's metrics (result keys as ``Tracker.compute`` reports them).
        per_step: one dict per step of the window, for the per-step metrics.
        num_rejected: steps (summed over ranks) with rejected tensor log calls.
    """

    window: dict[str, float] = field(default_factory=dict)
    per_step: list[dict[str, float]] = field(default_factory=list)
    num_rejected: float = 0.0


def decode(out: dict[str, float], num_steps: int) -> Decoded:
    """Split a reporter's ``compute()`` result into the window's parts.

    A replacing metric's value is taken from the youngest step any rank sent it for:
    the last step of the window in which it was logged.
    """
    decoded = Decoded(per_step=[{} for _ in range(num_steps)])
    latest: dict[str, int] = {}  # result key -> the youngest age seen
    for key, value in out.items():
        part, result_key = key.split("/", 1)
        tag, index = part[0], part[1:]
        if tag == "w":
            decoded.window.setdefault(result_key, value)
        elif tag == "l":
            age = int(index)
            if age < latest.get(result_key, num_steps):
                latest[result_key] = age
                decoded.window[result_key] = value  # overrides w/'s empty (NaN) value
        elif tag == "s":
            decoded.per_step[int(index)][result_key] = value
        elif tag == "r" and not math.isnan(value):
            decoded.num_rejected = value
    decoded.window = dict(sorted(decoded.window.items()))
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
    return kind.result(state, name) is not None


def empty_state(kind: Kind, num_nonfinite: float) -> MetricState:
    """An empty state of ``kind`` carrying a non-finite count."""
    return MetricState(
        kind.name,
        (0.0,) * kind.num_sums,
        (-math.inf,) * kind.num_maxes,
        kind.empty_extra() if kind.has_extra else None,
        num_nonfinite,
        kind.fingerprint(),
    )


__all__ = ["Decoded", "decode", "empty_state", "has_value", "latest_of", "window_key"]
