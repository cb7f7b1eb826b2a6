"""Weighted mean: state (Σ w·x, Σ w); result Σ w·x / Σ w."""

from __future__ import annotations

from rlmetrics.kinds.base import Kind, MetricState, ResultFormula
from rlmetrics.kinds.batch import Array, Batch


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

    def reduce(self, batch: Batch) -> tuple[Array, Array]:
        weights = batch.weights
        total = batch.sum_by(batch.values * weights)
        return batch.columns(total, batch.sum_by(weights)), batch.columns()

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        total, weight = state.sums
        if weight == 0:
            return None
        return {"": total / weight}
