"""Fixed-bin histogram: the worked example of a user-defined kind.

State: one additive count (Σ weight) per bin, plus an underflow and an overflow bin, and
two max slots (largest value, negated smallest value). Everything merges by SUM or MAX,
so the kind is packed into the same collective as the scalar kinds.

Bins are half-open, ``[edges[i], edges[i + 1])``, as ``np.searchsorted(edges, x,
side="right")`` assigns them: the underflow bin holds ``x < edges[0]``, the overflow
bin ``x >= edges[-1]`` (+inf included; -inf is underflow).

Non-finite values follow the tracker's ``nonfinite`` policy, as the built-in kinds do:
"skip" drops them (counted in ``name/nonfinite_count``), "error" rejects the call, and
under "propagate" a NaN, which lies in no bin, makes every result NaN (as in ``dist``
and ``quantile``): it shows in the observed range (the max slots), which merges carry.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from rlmetrics.kinds.base import Kind, MetricState
from rlmetrics.kinds.batch import Array, Batch
from rlmetrics.kinds.dist import DEFAULT_QUANTILES, check_quantiles, quantile_suffix


class Histogram(Kind):
    """Weighted counts in fixed bins, reported as fractions, with quantile estimates.

    Results, for a metric ``name``: ``name/count`` (total weight), ``name/under``,
    ``name/bin_0`` ... ``name/bin_{n-1}``, ``name/over`` (fractions of the total
    weight; ``report_bins=False`` leaves them out) and one ``name/pXX`` per quantile,
    interpolated linearly inside its bin. The underflow and overflow bins interpolate
    between the observed extreme and the outer edge, and every estimate is clamped to
    the observed [min, max], so ``p0`` and ``p100`` are exact.

    Args:
        name: the kind's registered name (log with ``tracker.log(..., kind=name)``).
        edges: at least two finite, strictly increasing bin edges.
        quantiles: the quantiles to estimate, each in [0, 1].
        report_bins: whether to report the per-bin fractions.

    Examples:
        >>> from rlmetrics import Tracker, register_kind, unregister_kind
        >>> kind = register_kind(Histogram(name="doc_hist", edges=[0, 1, 2, 4]))
        >>> t = Tracker()
        >>> t.log("latency", [0.5, 1.5, 1.5, 3.0], kind="doc_hist")
        >>> out = t.compute()
        >>> out["latency/bin_1"], out["latency/p50"]
        (0.5, 1.5)
        >>> unregister_kind("doc_hist")
    """

    def __init__(
        self,
        *,
        name: str,
        edges: Sequence[float],
        quantiles: Sequence[float] = DEFAULT_QUANTILES,
        report_bins: bool = True,
    ) -> None:
        edge_list = [float(e) for e in edges]
        if len(edge_list) < 2:
            raise ValueError(f"Histogram {name!r}: needs at least 2 edges, got {edge_list!r}")
        if not all(math.isfinite(e) for e in edge_list):
            raise ValueError(f"Histogram {name!r}: edges must be finite, got {edge_list!r}")
        if any(b <= a for a, b in itertools.pairwise(edge_list)):
            raise ValueError(
                f"Histogram {name!r}: edges must be strictly increasing, got {edge_list!r}"
            )
        self.name = name
        self.edges = tuple(edge_list)
        self.quantiles = check_quantiles(quantiles, f"Histogram {name!r}:")
        self.report_bins = bool(report_bins)
        self.num_sums = len(self.edges) + 1  # under, n - 1 inner bins, over
        self.num_maxes = 2  # max, -min

    # -- accumulation -----------------------------------------------------------------
    def reduce(self, batch: Batch) -> tuple[Array, Array]:
        """Per-bin Σ weight (SUM) and (max, -min) of the weighted elements (MAX)."""
        values, bins = batch.values, self.num_sums
        keys = batch.segments * bins + batch.searchsorted(self.edges, values, right=True)
        counts = batch.sum_by(batch.weights, keys, batch.num_rows * bins)
        extremes = batch.columns(batch.column_max("value"), batch.column_max("negated_value"))
        return counts.reshape(batch.num_rows, bins), extremes

    # -- result -------------------------------------------------------------------------
    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        """Fractions per bin and quantile estimates (host only)."""
        counts = np.asarray(state.sums, dtype=np.float64)
        total = counts.sum()
        if not total > 0:
            return None
        high, neg_low = state.maxes
        if math.isnan(high) or math.isnan(neg_low):  # a NaN was logged: it is in no bin
            return dict.fromkeys(self.result_names(), math.nan)
        out = {"count": float(total)}
        if self.report_bins:
            fractions = counts / total
            out["under"] = float(fractions[0])
            out.update({f"bin_{i}": float(f) for i, f in enumerate(fractions[1:-1])})
            out["over"] = float(fractions[-1])
        for q in self.quantiles:
            out[quantile_suffix(q)] = self.quantile(counts, -neg_low, high, q)
        return out

    def quantile(self, counts: np.ndarray, low: float, high: float, q: float) -> float:
        """The ``q`` quantile estimated from bin ``counts`` and the observed range."""
        if math.isnan(low) or math.isnan(high):
            return math.nan
        cumulative = np.cumsum(counts)
        target = q * cumulative[-1]
        i = int(np.flatnonzero((cumulative >= target) & (counts > 0))[0])
        lower = [low, *self.edges][i]
        upper = [*self.edges, high][i]
        lower, upper = max(lower, low), min(upper, high)
        before = cumulative[i] - counts[i]
        fraction = (target - before) / counts[i]
        if math.isfinite(lower) and math.isfinite(upper):
            return float(lower + fraction * (upper - lower))
        # an infinity was logged: inside a bin that reaches it, the estimate is that end
        if fraction <= 0 or (fraction < 1 and math.isinf(lower)):
            return float(lower)
        return float(upper)

    def result_names(self) -> tuple[str, ...]:
        bins = ("under", *(f"bin_{i}" for i in range(len(self.edges) - 1)), "over")
        return ("count", *(bins if self.report_bins else ()), *map(quantile_suffix, self.quantiles))

    # -- identity: equal configurations are the same kind ---------------------------------
    def config(self) -> tuple:
        return (self.name, self.edges, self.quantiles, self.report_bins)

    def fingerprint(self) -> str:
        return f"{super().fingerprint()}:{list(self.edges)!r}"

    def __repr__(self) -> str:
        return f"Histogram(name={self.name!r}, edges={list(self.edges)!r})"
