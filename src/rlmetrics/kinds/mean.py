"""Weighted mean: state (Σ w·x, Σ w); result Σ w·x / Σ w."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from rlmetrics.kinds.base import Accumulator, Kind, MetricState, ResultFormula


class Mean(Kind):
    """Weighted mean, merged by adding numerator and denominator.

    Never a mean of means: two pieces of 1 and 3 tokens merge to the 4-token mean.

    Example:
        >>> from rlmetrics import Tracker
        >>> t = Tracker()
        >>> t.mean("loss", 1.0, weight=1.0); t.mean("loss", 3.0, weight=3.0)
        >>> t.compute()["loss"]
        2.5
    """

    name = "mean"
    num_sums = 2
    result_formula = ResultFormula(value=0, divisor=1, present=1)

    def update(self, values: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor]:
        if weights is None:
            total = values.sum()
            count = values.new_full((), float(values.numel()))  # a fill: no host copy
        else:
            total = (values * weights).sum()
            count = weights.sum()
        return torch.stack((total, count)), values.new_empty(0)

    def add_float(self, acc: Accumulator, value: float, weight: float) -> None:
        sums = acc.sums
        sums[0] += value * weight
        sums[1] += weight

    def add_array(self, acc: Accumulator, values: np.ndarray, weights: np.ndarray | None) -> None:
        sums = acc.sums
        if weights is None:
            sums[0] += float(values.sum())
            sums[1] += values.size
        else:
            sums[0] += float(np.dot(values, weights))
            sums[1] += float(weights.sum())

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        total, weight = state.sums
        if weight == 0:
            return None
        return {"": total / weight}
