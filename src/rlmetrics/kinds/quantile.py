"""Quantiles in constant memory: a fixed-size, mergeable logarithmic sketch.

``dist`` keeps every element, so its sync grows with the batch. This kind keeps counts
in logarithmic buckets instead (the DDSketch idea): for a relative accuracy ``alpha``,
``gamma = (1 + alpha) / (1 - alpha)`` and bucket ``j`` of each sign holds the
magnitudes in ``(b[j-1], b[j]]`` with ``b[j] = min_positive * gamma**(j - 1)``. Any
value in a bucket is within relative error ``alpha`` of the bucket's representative
``2 * l * u / (l + u)`` (for bounds l, u: ``(u - l) / (u + l) = alpha``).

State (all of it additive or a max, so it rides in the packed SUM and MAX buffers with
no collective of its own), for ``K`` buckets per sign:

* SUM: ``[num, Σx, Σx², counts...]`` where ``counts`` (``2K + 6`` slots) are, in value
  order, the negative overflow bucket, the ``K`` negative buckets (largest magnitude
  first), the negative underflow bucket, exact zeros, the positive underflow bucket,
  the ``K`` positive buckets, the positive overflow bucket, then the NaN count.
* MAX: ``[max, -min]`` (exact).

Guarantee: the reported ``pXX`` is the element of 0-based rank ``floor(q * (n - 1))``
of the selected elements (numpy's ``method="lower"``), up to a relative error of
``alpha`` whenever that element's magnitude lies in ``[min_positive, max_value]``.
Magnitudes below the range (underflow) are reported with an absolute error below
``min_positive / 2``; magnitudes above it (overflow) are reported as the observed max
(or min, for negatives), which is exact for the extreme element and an overestimate of
the magnitude otherwise. Every estimate is clamped to the observed ``[min, max]``, so
``p0`` and ``p100`` are exact and a constant batch is reported exactly.

The bucket arithmetic is in module-level functions (``bucket_bounds``,
``bucket_slots``, ``sketch_results``) that work on numpy arrays and tensors alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

from rlmetrics.kinds.base import Kind, MetricState
from rlmetrics.kinds.batch import Array, Batch
from rlmetrics.kinds.dist import DEFAULT_QUANTILES, check_quantiles, quantile_suffix

NUM_MOMENTS = 3
"""SUM slots before the bucket counts: [num, Σx, Σx²]."""
MAX_SLOTS = 200_000
"""The largest state (SUM slots) a configuration may ask for: 1.6 MB per metric."""
STAT_NAMES = ("mean", "std", "min", "max")
ArrayT = TypeVar("ArrayT", Tensor, np.ndarray)


def bucket_bounds(alpha: float, min_positive: float, max_value: float) -> np.ndarray:
    """The bucket bounds ``b[0] < ... < b[K]`` of one sign's magnitudes, float64.

    ``b[j] = min_positive * gamma**(j - 1)``, so ``b[1]`` is ``min_positive`` and ``K``
    is the least count with ``b[K] >= max_value``.
    """
    gamma = (1.0 + alpha) / (1.0 - alpha)
    bounds = min_positive * np.power(
        gamma, np.arange(-1, num_bounds(alpha, min_positive, max_value) - 1, dtype=np.float64)
    )
    if bounds[-1] < max_value:  # log's rounding fell one short
        bounds = np.append(bounds, bounds[-1] * gamma)
    return bounds


def num_bounds(alpha: float, min_positive: float, max_value: float) -> int:
    """How many bounds ``bucket_bounds`` makes (``K + 1``; it may add one more where
    ``log`` rounds down)."""
    gamma = (1.0 + alpha) / (1.0 - alpha)
    return 2 + math.ceil(math.log(max_value / min_positive) / math.log(gamma))


def bucket_values(bounds: np.ndarray) -> np.ndarray:
    """Each bucket's representative value, in the state's count order (without the
    NaN slot): ``2lu / (l + u)`` inside the range, ``b[0] / 2`` for underflow, ±inf for
    overflow (clamped to the observed max or min when read)."""
    low, high = bounds[:-1], bounds[1:]
    inner = 2.0 * low * high / (low + high)
    positive = np.concatenate(([bounds[0] / 2.0], inner, [math.inf]))
    return np.concatenate((-positive[::-1], [0.0], positive))


def bucket_error(bounds: np.ndarray) -> float:
    """The largest relative error of a representative over its bucket (about alpha)."""
    low, high = bounds[:-1], bounds[1:]
    return float(np.max((high - low) / (high + low)))


def bucket_slots(values: ArrayT, bounds: ArrayT) -> ArrayT:
    """Each value's count slot (int64), for a torch tensor (no host sync, same device)
    or a numpy array, by the same comparisons: see the module docstring for the order;
    NaN goes to the last slot, ``2K + 5`` for ``K + 1`` bounds."""
    xp = torch if isinstance(values, Tensor) else np
    zero_slot = len(bounds) + 1  # K + 2 negative buckets come first
    # side "left": slot j for b[j-1] < |x| <= b[j]; 0 up to b[0]; K + 1 above b[K] (inf)
    index = xp.searchsorted(bounds, abs(values))
    slots = xp.where(values > 0, zero_slot + 1 + index, zero_slot - 1 - index)
    slots = xp.where(values == 0, zero_slot, slots)
    return xp.where(xp.isnan(values), 2 * zero_slot + 1, slots)


def sketch_quantiles(
    counts: np.ndarray, reps: np.ndarray, low: np.ndarray, high: np.ndarray, qs: np.ndarray
) -> np.ndarray:
    """(m, Q) quantile estimates of m sketches from their (m, B) bucket ``counts`` (value
    order, no NaN slot), the representatives ``reps`` (B,) and the observed ``low`` and
    ``high`` (m,): the element of rank ``floor(q * (n - 1))``, read as its bucket's
    representative and clamped to [low, high] (ranks 0 and n - 1: low and high
    themselves). Rows with no element give NaN."""
    total = counts.sum(axis=1)
    ranks = np.floor(qs[None, :] * (total[:, None] - 1.0))
    cumulative = np.cumsum(counts, axis=1)
    # the first bucket whose cumulative count exceeds the rank
    index = (cumulative[:, None, :] <= ranks[:, :, None]).sum(axis=-1)
    estimate = reps[np.minimum(index, reps.size - 1)]
    estimate = np.minimum(np.maximum(estimate, low[:, None]), high[:, None])
    # the first and last ranks are the observed min and max: exact
    estimate = np.where(ranks <= 0, low[:, None], estimate)
    estimate = np.where(ranks >= total[:, None] - 1, high[:, None], estimate)
    return np.where(total[:, None] > 0, estimate, math.nan)


def sketch_results(
    sums: np.ndarray, maxes: np.ndarray, reps: np.ndarray, qs: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Results of m sketches from their (m, S) sums and (m, 2) maxes: (values, present),
    values (m, 4 + Q) in the order mean, std, min, max, then ``qs``.

    std is the population std from (n, Σx, Σx²), exactly 0 when min == max; any NaN
    element makes every result NaN (as ``dist``'s numpy arithmetic does).
    """
    num, total, squares = sums[:, 0], sums[:, 1], sums[:, 2]
    counts, num_nan = sums[:, NUM_MOMENTS:-1], sums[:, -1]
    high, low = maxes[:, 0], -maxes[:, 1]
    present = num > 0
    with np.errstate(all="ignore"):  # empty rows, inf - inf
        mean = total / num
        var = np.maximum(squares / num - mean * mean, 0.0)
        std = np.where(low == high, 0.0, np.sqrt(var))
        quantiles = sketch_quantiles(counts, reps, low, high, qs)
    quantiles = np.where(num_nan[:, None] > 0, math.nan, quantiles)
    values = np.column_stack((mean, std, low, high, quantiles))
    return values, present


class QuantileSketch(Kind):
    """Mean, std, min, max and quantiles of every element with weight > 0, in a state of
    fixed size (a logarithmic sketch: see ``rlmetrics.kinds.quantile``).

    Results, for a metric ``name``: the keys ``dist`` reports, ``name/mean``,
    ``name/std``, ``name/min``, ``name/max`` and one ``name/pXX`` per quantile. min, max
    and mean are exact (mean to float64 rounding, as ``mean``); std comes from
    (n, Σx, Σx²), so it loses about ``1e-16 * (mean / std)**2`` relative accuracy to
    cancellation; ``pXX`` is the element of rank ``floor(q * (n - 1))`` (numpy's
    ``method="lower"``) within relative error ``alpha`` for magnitudes in
    ``[min_positive, max_value]`` (``dist`` interpolates between that element and the
    next one up). A weight selects an element (> 0) as in ``dist``; it is not a count.

    Args:
        name: the kind's registered name.
        alpha: the relative accuracy, in (0, 1).
        min_positive: the smallest magnitude with the relative guarantee (> 0).
        max_value: the largest magnitude with the relative guarantee (> min_positive).
        quantiles: the quantiles to report, each in [0, 1].

    Raises:
        ValueError: naming the argument, when a parameter is out of range or the state
            would exceed ``MAX_SLOTS``.

    Examples:
        >>> from rlmetrics import Tracker, register_kind, unregister_kind
        >>> kind = register_kind(QuantileSketch(name="doc_sketch", alpha=0.01))
        >>> t = Tracker()
        >>> t.log("len", [1.0, 2.0, 3.0, 100.0], kind="doc_sketch")
        >>> out = t.compute()
        >>> out["len/max"], abs(out["len/p50"] - 2.0) <= 0.01 * 2.0
        (100.0, True)
        >>> unregister_kind("doc_sketch")
    """

    name = "quantile"  # the default; an instance may take another
    num_maxes = 2  # max, -min

    def __init__(
        self,
        *,
        name: str = "quantile",
        alpha: float = 0.01,
        min_positive: float = 1e-9,
        max_value: float = 1e9,
        quantiles: Sequence[float] = DEFAULT_QUANTILES,
    ) -> None:
        alpha, min_positive, max_value = check_config(name, alpha, min_positive, max_value)
        self.name = name
        self.alpha, self.min_positive, self.max_value = alpha, min_positive, max_value
        self.quantiles = check_quantiles(quantiles, f"QuantileSketch {name!r}:")
        num_sums = NUM_MOMENTS + 2 * num_bounds(alpha, min_positive, max_value) + 4
        if num_sums > MAX_SLOTS:
            raise ValueError(
                f"QuantileSketch {name!r}: alpha={alpha!r} over [{min_positive!r}, "
                f"{max_value!r}] needs {num_sums} slots, more than {MAX_SLOTS}; "
                "raise alpha or narrow the range"
            )
        self.bounds = bucket_bounds(alpha, min_positive, max_value)
        self.num_sums = NUM_MOMENTS + 2 * self.bounds.size + 4
        self.reps = bucket_values(self.bounds)
        self.relative_error = bucket_error(self.bounds)

    # -- accumulation -----------------------------------------------------------------
    def reduce(self, batch: Batch) -> tuple[Array, Array]:
        """Per metric, the moments and bucket counts of the selected elements (SUM) and
        their (max, -min) (MAX). A deselected element is 0 by now, in the zero slot with
        weight 0: it adds nothing."""
        values, selected = batch.values, batch.selected()
        width = self.num_sums - NUM_MOMENTS
        bounds = self.bounds if batch.on_host else batch.constant(self.bounds)
        keys = batch.segments * width + bucket_slots(values, bounds)
        counts = batch.sum_by(selected * 1.0, keys, batch.num_rows * width)
        moments = batch.columns(batch.count(), batch.sum_by(values), batch.sum_by(values * values))
        sums = batch.concat(moments, counts.reshape(batch.num_rows, width))
        return sums, batch.columns(batch.column_max("value"), batch.column_max("negated_value"))

    # -- result -------------------------------------------------------------------------
    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        """mean, std, min, max and the quantiles (host only)."""
        sums = np.asarray(state.sums, dtype=np.float64)[None, :]
        maxes = np.asarray(state.maxes, dtype=np.float64)[None, :]
        values, present = sketch_results(sums, maxes, self.reps, np.asarray(self.quantiles))
        if not present[0]:
            return None
        return dict(zip(self.result_names(), values[0].tolist(), strict=True))

    def result_names(self) -> tuple[str, ...]:
        return (*STAT_NAMES, *map(quantile_suffix, self.quantiles))

    # -- identity: equal configurations are the same kind ---------------------------------
    def config(self) -> tuple:
        return (self.name, self.alpha, self.min_positive, self.max_value, self.quantiles)

    def fingerprint(self) -> str:
        return f"{super().fingerprint()}:{self.alpha!r}:{self.min_positive!r}:{self.max_value!r}"

    def __repr__(self) -> str:
        return (
            f"QuantileSketch(name={self.name!r}, alpha={self.alpha!r}, "
            f"min_positive={self.min_positive!r}, max_value={self.max_value!r})"
        )


def check_config(
    name: str, alpha: object, min_positive: object, max_value: object
) -> tuple[float, float, float]:
    """The sketch's parameters as floats, checked.

    Raises:
        TypeError: a parameter is not a real number.
        ValueError: naming the parameter and its value, when out of range.
    """
    owner = f"QuantileSketch {name!r}:"
    checked = []
    for arg, value in (("alpha", alpha), ("min_positive", min_positive), ("max_value", max_value)):
        if isinstance(value, bool) or not isinstance(value, int | float | np.floating):
            raise TypeError(f"{owner} {arg} must be a real number, got {value!r}")
        checked.append(float(value))
    alpha, min_positive, max_value = checked
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"{owner} alpha must lie in (0, 1), got {alpha!r}")
    if not np.finfo(np.float64).tiny <= min_positive < math.inf:
        raise ValueError(f"{owner} min_positive must be a normal float > 0, got {min_positive!r}")
    if not min_positive < max_value <= 1e300:
        raise ValueError(
            f"{owner} max_value must lie in (min_positive={min_positive!r}, 1e300], "
            f"got {max_value!r}"
        )
    return alpha, min_positive, max_value
