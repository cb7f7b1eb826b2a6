"""Weighted mean: state (Σ w·x, Σ w); result Σ w·x / Σ w."""

from __future__ import annotations

import numpy as np

from rlmetrics.kinds.base import Kind, ResultColumns


class Mean(Kind):
    """Weighted mean, merged by adding numerator and denominator.

    Never a mean of means: two pieces of 1 and 3 tokens merge to the 4-token mean.

    Examples:
        >>> from rlmetrics import Tracker
        >>> t = Tracker()
        >>> t.mean("loss", 1.0, weight=1.0); t.mean("loss", 3.0, weight=3.0)
        >>> t.compute()["loss"]
        2.5
    """

    name = "mean"
    sum_columns = ("weighted_value", "weight")

    def result_columns(self, sums: np.ndarray, maxes: np.ndarray, *_: object) -> ResultColumns:
        total, weight = sums[:, 0], sums[:, 1]
        present = weight != 0
        return {"": total / (weight + ~present)}, present  # an empty row divides by 1
