"""verl's metric helpers (``verl.utils.metric``), same behaviour, plus a way out.

Replace ``from verl.utils.metric import Metric, reduce_metrics`` with
``from rlmetrics.compat.verl import Metric, reduce_metrics``: the same inputs give the
same results. What is added:

* ``Metric.append(value, weight=w)`` keeps a weight per value. A MEAN Metric then
  aggregates to ``Σ w·x / Σ w`` (the exact mean over tokens or sequences, not a mean of
  micro-batch means); weights survive ``extend``, ``chain`` and ``append_to_dict``.
* ``MetricsAggregator`` (verl's per-step reduction of several iterations' metrics),
  on rlmetrics states: see ``rlmetrics.compat.verl.aggregator``, and the fully-async
  policy's copy, ``FullyAsyncMetricsAggregator``.
* ``Metric.to_state()`` / ``Metric.from_state()`` and ``to_tracker_state()`` /
  ``from_tracker_state()`` convert to rlmetrics' mergeable states, so workers can
  return ``TrackerState``s and the driver merges them exactly.

Where verl crashes or is undefined, this module decides (see docs/migrating-from-verl.md):
an empty MEAN/MIN/MAX gives NaN (verl: NaN with a RuntimeWarning, or a ValueError for
MIN/MAX), an empty SUM 0.0 (as verl); ``Metric(agg, [1, 2])`` adds both values (verl's
docstring promises it, its code raises); a plain list under a key that also holds
Metric objects is reduced with the Metrics' aggregation (verl: TypeError).
"""

from rlmetrics.compat.verl.aggregator import MetricsAggregator
from rlmetrics.compat.verl.async_aggregator import FullyAsyncMetricsAggregator
from rlmetrics.compat.verl.metric import (
    AggregationType,
    Metric,
    append_to_dict,
    as_scalar,
    from_tracker_state,
    reduce_metrics,
    to_tracker_state,
)

__all__ = [
    "AggregationType",
    "FullyAsyncMetricsAggregator",
    "Metric",
    "MetricsAggregator",
    "append_to_dict",
    "as_scalar",
    "from_tracker_state",
    "reduce_metrics",
    "to_tracker_state",
]
