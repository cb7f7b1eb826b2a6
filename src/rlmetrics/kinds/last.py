"""Last / replicated: the latest value on a rank; across ranks, values must agree.

State: sums (Σ v, number of sources), maxes (v, -v). A new value on a rank replaces the
rank's state; merging adds sources, so disagreement shows as max != min, without a
gather.

A disagreement is reported as the sources' mean, with a RuntimeWarning once per
disagreement of a name in the process: when its merged values start to disagree, and
again only after they have agreed in a later result (two or more sources with one
value; a single source, such as a rank's own state, agrees with nothing). A name that
keeps disagreeing step after step warns once, not every step; one that disagrees again
later is reported again, its message numbered so that Python's own once-per-message
filter does not hide it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

from rlmetrics.kinds.base import Kind, ResultColumns

_warned: set[str] = set()  # the names whose current disagreement was warned about
_disagreements: dict[str, int] = {}  # per name, its disagreements warned about so far


class Last(Kind):
    """A replicated value (learning rate, KL coefficient): the value in effect.

    Examples:
        >>> from rlmetrics import Tracker
        >>> t = Tracker()
        >>> t.last("lr", 1e-3); t.last("lr", 2e-3)
        >>> t.compute()["lr"]
        0.002
    """

    name = "last"
    keeps_latest = True  # the columns are taken at a rank's latest value
    sum_columns = ("value", "selected")  # merged: Σ v, sources
    max_columns = ("value", "negated_value")  # merged: max, -min

    def result_columns(
        self, sums: np.ndarray, maxes: np.ndarray, extras: object, names: Sequence[str]
    ) -> ResultColumns:
        total, sources = sums[:, 0], sums[:, 1]
        high, neg_low = maxes[:, 0], maxes[:, 1]
        present = sources != 0
        disagree = high > -neg_low  # max > min (False where NaN, or empty)
        if _warned:  # a disagreement ends where two or more sources agree
            agree = (sources > 1) & ~disagree
            _warned.difference_update(names[i] for i in np.flatnonzero(agree).tolist())
        if not np.count_nonzero(disagree):
            return {"": high}, present
        for i in np.flatnonzero(disagree).tolist():
            if names[i] not in _warned:
                _warned.add(names[i])
                number = _disagreements[names[i]] = _disagreements.get(names[i], 0) + 1
                warnings.warn(
                    f"metric {names[i]!r} (kind 'last'): merged values disagree "
                    f"(min {-float(neg_low[i])!r}, max {float(high[i])!r}, "
                    f"{sources[i]:g} sources); reporting their mean. Disagreement {number} "
                    "of this metric in this process: not warned again until its values agree",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return {"": np.where(disagree, total / np.where(present, sources, 1.0), high)}, present
