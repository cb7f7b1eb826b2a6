"""Metric updates: what a loss helper returns instead of logging (STYLE rule 14)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlmetrics.tracker import LogTarget


@dataclass(frozen=True, slots=True)
class MetricUpdate:
    """One pending log call: ``tracker.log(name, value, weight, kind=kind)``.

    Attributes:
        name: the metric's full name, e.g. ``"actor/pg_clipfrac"``.
        kind: a registered kind ("mean", "max", "last", ...).
        value: a number or tensor (detached; stays on its device).
        weight: the value's weight (a multiplier for mean, std, sum; a selector, > 0, for
            max, min, dist, last), or None.
    """

    name: str
    kind: str
    value: Any
    weight: Any = None


def log_updates(tracker: LogTarget, updates: Iterable[MetricUpdate]) -> None:
    """Apply ``updates`` to ``tracker`` (a Tracker or a prefixed view); no host sync.

    Consecutive updates of the same value and weight objects (``extremes``' mean, max
    and min) go through one ``log_shared`` call, which converts their input once. The
    updates land in one step together: a ``compute()`` in another thread comes before
    or after all of them.
    """
    group: list[MetricUpdate] = []
    with tracker._holding():
        for update in updates:
            if group and (
                update.value is not group[0].value or update.weight is not group[0].weight
            ):
                _log_group(tracker, group)
                group = []
            group.append(update)
        if group:
            _log_group(tracker, group)


def _log_group(tracker: LogTarget, group: list[MetricUpdate]) -> None:
    first = group[0]
    if len(group) == 1:
        tracker.log(first.name, first.value, first.weight, kind=first.kind)
    else:
        tracker.log_shared([(u.name, u.kind) for u in group], first.value, first.weight)


def bool_mask(mask: Tensor) -> Tensor:
    """``mask`` (bool, int or float 0/1) as a bool tensor."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked(values: Tensor, mask: Tensor) -> Tensor:
    """``values`` with masked-out positions set to 0 (also drops NaN/inf padding)."""
    return values.where(bool_mask(mask), values.new_zeros(()))


def token_mean(name: str, values: Tensor, mask: Tensor) -> MetricUpdate:
    """A per-token mean: weight 1 per valid token, so merges average over all tokens."""
    mask = bool_mask(mask)
    return MetricUpdate(name, "mean", masked(values.detach(), mask), mask)


def extremes(name: str, values: Tensor, mask: Tensor | None = None) -> list[MetricUpdate]:
    """``name/mean`` (weight 1 per selected element), ``name/max`` and ``name/min``."""
    values = values.detach()
    if mask is None:
        return [
            MetricUpdate(f"{name}/mean", "mean", values),
            MetricUpdate(f"{name}/max", "max", values),
            MetricUpdate(f"{name}/min", "min", values),
        ]
    mask = bool_mask(mask)
    clean = masked(values, mask)
    return [
        MetricUpdate(f"{name}/mean", "mean", clean, mask),
        MetricUpdate(f"{name}/max", "max", clean, mask),
        MetricUpdate(f"{name}/min", "min", clean, mask),
    ]
