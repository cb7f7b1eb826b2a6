"""Last / replicated: the latest value on a rank; across ranks, values must agree.

State: sums (Σ v, number of sources), maxes (v, -v). A new value on a rank replaces the
rank's state; merging adds sources, so disagreement shows as max != min, without a
gather.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

from rlmetrics.kinds.base import Kind, Rows

_warned: set[str] = set()


class Last(Kind):
    """A replicated value (learning rate, KL coefficient): the value in effect.

    Example:
        >>> from rlmetrics import Tracker
        >>> t = Tracker()
        >>> t.last("lr", 1e-3); t.last("lr", 2e-3)
        >>> t.compute()["lr"]
        0.002
    """

    name = "last"
    replaces = True  # the columns are taken at a rank's latest value
    sum_columns = ("value", "selected")  # merged: Σ v, sources
    max_columns = ("value", "negated_value")  # merged: max, -min

    def result_rows(
        self, sums: np.ndarray, maxes: np.ndarray, extras: object, names: Sequence[str]
    ) -> Rows:
        total, sources = sums[:, 0], sums[:, 1]
        high, neg_low = maxes[:, 0], maxes[:, 1]
        present = sources != 0
        disagree = high > -neg_low  # max > min (False where NaN, or empty)
        if not np.count_nonzero(disagree):
            return {"": high}, present
        for i in np.flatnonzero(disagree).tolist():
            if names[i] not in _warned:
                _warned.add(names[i])
                warnings.warn(
                    f"metric {names[i]!r} (kind 'last'): merged values disagree "
                    f"(min {-float(neg_low[i])!r}, max {float(high[i])!r}, "
                    f"{sources[i]:g} sources); "
                    "reporting their mean",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return {"": np.where(disagree, total / np.where(present, sources, 1.0), high)}, present
