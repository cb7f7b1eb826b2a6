"""Sum: state (Σ x, number of elements); result Σ x."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from rlmetrics.kinds.base import Accumulator, Kind, MetricState, ResultFormula


class Sum(Kind):
    """Sum of every element logged; empty (omitted) when no element was logged.

    Example:
        >>> from rlmetrics import Tracker
        >>> t = Tracker()
        >>> t.sum("tokens", 3); t.sum("tokens", 4)
        >>> t.compute()["tokens"]
        7.0
    """

    name = "sum"
    num_sums = 2
    result_formula = ResultFormula(value=0, present=1)
    takes_weight = False

    def update(self, values: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor]:
        if weights is None:
            count = values.new_full((), float(values.numel()))  # a fill: no host copy
            return torch.stack((values.sum(), count)), values.new_empty(0)
        kept = weights > 0
        return torch.stack(
            (torch.where(kept, values, 0).sum(), kept.sum().double())
        ), values.new_empty(0)

    def add_float(self, acc: Accumulator, value: float, weight: float) -> None:
        sums = acc.sums
        sums[0] += value
        sums[1] += 1.0

    def add_array(self, acc: Accumulator, values: np.ndarray, weights: np.ndarray | None) -> None:
        sums = acc.sums
        if weights is None:
            sums[0] += float(values.sum())
            sums[1] += values.size
        else:
            kept = weights > 0
            sums[0] += float(np.where(kept, values, 0.0).sum())
            sums[1] += float(np.count_nonzero(kept))

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        total, count = state.sums
        if count == 0:
            return None
        return {"": total}
