"""Max and min: state (number of elements, extreme); min is stored as max of negatives."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from rlmetrics.kinds.base import Accumulator, Kind, MetricState, ResultFormula


def _count(values: Tensor, weights: Tensor | None) -> Tensor:
    if weights is None:
        return values.new_full((1,), float(values.numel()))  # a fill: no host copy
    return (weights > 0).sum().double().reshape(1)


def _masked_max(values: Tensor, weights: Tensor | None) -> Tensor:
    if weights is not None:
        values = torch.where(weights > 0, values, -math.inf)
    if values.numel() == 0:
        return torch.full((1,), -math.inf, dtype=torch.float64, device=values.device)
    # amax propagates NaN, like the merge and all_reduce(MAX).
    return values.amax().reshape(1)


def _add_extreme(acc: Accumulator, values: np.ndarray, weights: np.ndarray | None) -> None:
    """Count the selected elements and fold their max into the host state."""
    if weights is not None:
        kept = weights > 0
        acc.sums[0] += float(np.count_nonzero(kept))
        values = np.where(kept, values, -math.inf)
    else:
        acc.sums[0] += values.size
    if values.size:
        acc.add_host((), (float(values.max()),))  # max propagates NaN, like the merge


class Max(Kind):
    """Largest element logged (a weight or mask > 0 selects the elements).

    Example:
        >>> from rlmetrics import Tracker
        >>> t = Tracker()
        >>> t.max("len", 3); t.max("len", 7)
        >>> t.compute()["len"]
        7.0
    """

    name = "max"
    num_sums = 1
    num_maxes = 1
    result_formula = ResultFormula(value=1, present=0)  # state: [count, max]
    takes_weight = False

    def update(self, values: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor]:
        return _count(values, weights), _masked_max(values, weights)

    def add_float(self, acc: Accumulator, value: float, weight: float) -> None:
        acc.sums[0] += 1.0
        current = acc.maxes[0]
        if (value > current or value != value) and current == current:
            acc.maxes[0] = value

    def add_array(self, acc: Accumulator, values: np.ndarray, weights: np.ndarray | None) -> None:
        _add_extreme(acc, values, weights)

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        if state.sums[0] == 0:
            return None
        return {"": state.maxes[0]}


class Min(Kind):
    """Smallest element logged, stored as the max of the negated values.

    Example:
        >>> from rlmetrics import Tracker
        >>> t = Tracker()
        >>> t.min("len", 3); t.min("len", 7)
        >>> t.compute()["len"]
        3.0
    """

    name = "min"
    num_sums = 1
    num_maxes = 1
    result_formula = ResultFormula(value=1, present=0, negate=True)  # state: [count, -min]
    takes_weight = False

    def update(self, values: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor]:
        return _count(values, weights), _masked_max(-values, weights)

    def add_float(self, acc: Accumulator, value: float, weight: float) -> None:
        acc.sums[0] += 1.0
        current = acc.maxes[0]
        if (-value > current or value != value) and current == current:
            acc.maxes[0] = -value

    def add_array(self, acc: Accumulator, values: np.ndarray, weights: np.ndarray | None) -> None:
        _add_extreme(acc, -values, weights)

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        if state.sums[0] == 0:
            return None
        return {"": -state.maxes[0]}
