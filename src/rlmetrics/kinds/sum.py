"""Sum: state (Σ w·x, number of elements with weight > 0); result Σ w·x."""

from __future__ import annotations

import numpy as np

from rlmetrics.kinds.base import Kind, ResultColumns


class Sum(Kind):
    """Weighted sum of every element logged (a weight multiplies its element; a bool mask
    selects); empty (omitted) when no element with weight > 0 was logged.

    Examples:
        >>> from rlmetrics import Tracker
        >>> t = Tracker()
        >>> t.sum("tokens", 3); t.sum("tokens", 4); t.sum("tokens", 5, weight=2)
        >>> t.compute()["tokens"]
        17.0
    """

    name = "sum"
    sum_columns = ("weighted_value", "selected")

    def result_columns(self, sums: np.ndarray, maxes: np.ndarray, *_: object) -> ResultColumns:
        return {"": sums[:, 0]}, sums[:, 1] != 0
