"""Last / replicated: the latest value on a rank; across ranks, values must agree.

State: sums (Σ v, number of sources), maxes (v, -v). A new value on a rank replaces the
rank's state; merging adds sources, so disagreement shows as max != min, without a
gather.
"""

from __future__ import annotations

import math
import warnings

from rlmetrics.kinds.base import Kind, MetricState, ResultFormula
from rlmetrics.kinds.batch import Array, Batch

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
    num_sums = 2
    num_maxes = 2
    # state: [Σ v, sources, v, -v]; ranks that disagree go through ``result`` (it warns)
    result_formula = ResultFormula(value=2, present=1, negated_copy=3)
    replaces = True

    def reduce(self, batch: Batch) -> tuple[Array, Array]:
        value, present = batch.last_by(batch.values)
        high = batch.where(present > 0, value, -math.inf)
        neg_low = batch.where(present > 0, -value, -math.inf)
        return batch.columns(value, present), batch.columns(high, neg_low)

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        total, sources = state.sums
        if sources == 0:
            return None
        high, neg_low = state.maxes
        if high == -neg_low or math.isnan(high):
            return {"": high}
        if name not in _warned:
            _warned.add(name)
            warnings.warn(
                f"metric {name!r} (kind 'last'): merged values disagree "
                f"(min {-neg_low!r}, max {high!r}, {sources:g} sources); reporting their mean",
                RuntimeWarning,
                stacklevel=2,
            )
        return {"": total / sources}
