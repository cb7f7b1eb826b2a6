"""Sum: state (Σ w·x, number of elements with weight > 0); result Σ w·x."""

from __future__ import annotations

from rlmetrics.kinds.base import Kind, MetricState, ResultFormula
from rlmetrics.kinds.batch import Array, Batch


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

    def reduce(self, batch: Batch) -> tuple[Array, Array]:
        total = batch.sum_by(batch.values * batch.weights)
        return batch.columns(total, batch.count()), batch.columns()

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        total, count = state.sums
        if count == 0:
            return None
        return {"": total}
