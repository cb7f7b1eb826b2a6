"""Max and min: state (number of elements, extreme); min is stored as max of negatives."""

from __future__ import annotations

import numpy as np

from rlmetrics.kinds.base import Kind, ResultColumns


class Max(Kind):
    """Largest element logged (a weight or mask > 0 selects the elements).

    Examples:
        >>> from rlmetrics import Tracker
        >>> t = Tracker()
        >>> t.max("len/max", 3); t.max("len/max", 7); t.min("len/min", [3, 7])
        >>> t.compute()
        {'len/max': 7.0, 'len/min': 3.0}
    """

    name = "max"
    sum_columns = ("selected",)  # the number of elements
    max_columns = ("value",)  # NaN wins, as in the merge and all_reduce(MAX)
    sign = 1.0

    def result_columns(self, sums: np.ndarray, maxes: np.ndarray, *_: object) -> ResultColumns:
        return {"": self.sign * maxes[:, 0]}, sums[:, 0] != 0  # state: [count], [max]


class Min(Max):
    """Smallest element logged (a weight or mask > 0 selects), stored as the max of the
    negated values so that it merges, packs and syncs as ``Max`` does."""

    name = "min"
    max_columns = ("negated_value",)
    sign = -1.0
