"""Sum: state (Σ w·x, number of elements with weight > 0); result Σ w·x."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from rlmetrics.kinds.base import Accumulator, Kind, MetricState, ResultFormula


class Sum(Kind):
    """Weighted sum of every element logged (a weight multiplies its element; a bool mask
    selects); empty (omitted) when no element with weight > 0 was logged.

    Example:
        >>> from rlmetrics import Tracker
        >>> t = Tracker()
        >>> t.sum("tokens", 3); t.sum("tokens", 4); t.sum("tokens", 5, weight=2)
        >>> t.compute()["tokens"]
        17.0
    """

    name = "sum"
    num_sums = 2
    result_formula = ResultFormula(value=0, present=1)

    def update(self, values: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor]:
        if weights is None:
            count = values.new_full((), float(values.numel()))  # a fill: no host copy
            return torch.stack((values.sum(), count)), values.new_empty(0)
        count = (weights > 0).sum().double()
        return torch.stack(((values * weights).sum(), count)), values.new_empty(0)

    def add_float(self, acc: Accumulator, value: float, weight: float) -> None:
        sums = acc.sums
        sums[0] += value * weight
        sums[1] += 1.0

    def add_array(self, acc: Accumulator, values: np.ndarray, weights: np.ndarray | None) -> None:
        sums = acc.sums
        if weights is None:
            sums[0] += float(values.sum())
            sums[1] += values.size
        else:
            sums[0] += float(np.dot(values, weights))
            sums[1] += float(np.count_nonzero(weights > 0))

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        total, count = state.sums
        if count == 0:
            return None
        return {"": total}
