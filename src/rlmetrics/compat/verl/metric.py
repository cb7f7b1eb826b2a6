"""verl.utils.metric's names with exact, weighted semantics underneath (``Metric``,
``AggregationType``, ``reduce_metrics``, ``append_to_dict``) and their conversion to
rlmetrics states. The package's leaf: the aggregators import it, it imports neither of
them (see ``rlmetrics.compat.verl`` for the whole story)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from enum import Enum
from typing import Any

import numpy as np
import torch

from rlmetrics.kinds import MetricState, get_kind
from rlmetrics.kinds.base import result_of
from rlmetrics.state import TrackerState
from rlmetrics.tracker import Tracker


class AggregationType(Enum):
    """How a Metric's values combine; built from "mean", "sum", "min" or "max"."""

    MEAN = "mean"
    SUM = "sum"
    MIN = "min"
    MAX = "max"


_NUMPY_REDUCE: dict[AggregationType, Callable[..., Any]] = {
    AggregationType.MEAN: np.mean,
    AggregationType.SUM: np.sum,
    AggregationType.MIN: np.min,
    AggregationType.MAX: np.max,
}


def _aggregation(aggregation: Any) -> AggregationType:
    if isinstance(aggregation, str):
        return AggregationType(aggregation)
    if not isinstance(aggregation, AggregationType):
        raise ValueError(f"Unsupported aggregation type: {aggregation!r}")
    return aggregation


def as_scalar(value: Any) -> int | float:
    """A scalar value as a python number (a tensor or array must hold one element).

    Raises:
        ValueError: a non-scalar tensor or array, or a value that is not a number.
    """
    if isinstance(value, torch.Tensor | np.ndarray):
        if value.size == 1 if isinstance(value, np.ndarray) else value.numel() == 1:
            return value.item() if isinstance(value, np.ndarray) else value.detach().item()
        raise ValueError(
            f"Only scalar tensors can be converted to float, got shape {tuple(value.shape)}"
        )
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, int | float):
        return value
    raise ValueError(f"Unsupported value type: {type(value)}")


def _check_weight(weight: Any) -> float:
    weight = float(as_scalar(weight))
    if not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"Metric weights must be finite and >= 0, got {weight!r}")
    return weight


class Metric:
    """Values of one metric and how they aggregate (verl's ``Metric``), with weights.

    Args:
        aggregation: "mean", "sum", "min", "max" or an ``AggregationType``.
        value: a first value, or a list of values.

    Examples:
        >>> m = Metric("mean")
        >>> m.append(1.0, weight=1); m.append(3.0, weight=3)
        >>> m.aggregate()
        2.5
    """

    def __init__(self, aggregation: str | AggregationType, value: Any = None) -> None:
        self.aggregation = _aggregation(aggregation)
        self.values: list[int | float] = []
        self.weights: list[float] = []
        if isinstance(value, list | tuple):
            self.extend(value)
        elif value is not None:
            self.append(value)

    def append(self, value: Any, weight: Any = 1.0) -> None:
        """Add one value (a scalar tensor syncs, as in verl) with its weight.

        A Metric is extended instead. For MEAN the weight is what the value stands
        for (tokens, sequences); for SUM, MIN and MAX a weight of 0 drops the value and
        other weights do not matter.
        """
        if isinstance(value, Metric):
            self.extend(value)
            return
        scalar = as_scalar(value)
        self.weights.append(_check_weight(weight))
        self.values.append(scalar)

    def extend(self, values: Metric | Iterable[Any], weights: Iterable[Any] | None = None) -> None:
        """Add another Metric's values and weights (same aggregation), or many values.

        Raises:
            ValueError: the other Metric aggregates differently, or the lengths differ.
        """
        if isinstance(values, Metric):
            if values.aggregation != self.aggregation:
                raise ValueError(
                    f"Aggregation type mismatch: {self.aggregation} != {values.aggregation}"
                )
            weights = list(values.weights)
            values = list(values.values)
        values = list(values)
        weights = [1.0] * len(values) if weights is None else list(weights)
        if len(weights) != len(values):
            raise ValueError(f"extend got {len(values)} values but {len(weights)} weights")
        for value, weight in zip(values, weights, strict=True):
            self.append(value, weight)

    @property
    def weighted(self) -> bool:
        """True when some weight is not 1."""
        return any(w != 1.0 for w in self.weights)

    def aggregate(self) -> float:
        """The aggregate: verl's numpy reduction, or the exact weighted one."""
        if self.weighted:
            return _state_value(self.to_state())
        if not self.values:
            return 0.0 if self.aggregation is AggregationType.SUM else math.nan
        return float(_NUMPY_REDUCE[self.aggregation](self.values))

    @classmethod
    def aggregate_dp(cls, metric_lists: list[Metric]) -> float:
        """verl's reduction over data-parallel ranks (one Metric per rank).

        Unweighted, as verl: MEAN and SUM take the mean over ranks at each position,
        then aggregate; MIN and MAX aggregate all values. Weighted Metrics give the
        exact aggregate of all values.
        """
        if not metric_lists:
            raise ValueError("Cannot aggregate an empty list of metrics.")
        lengths = [len(m.values) for m in metric_lists]
        if len(set(lengths)) != 1:
            raise ValueError(f"All Metrics must have as many values for dp aggregation: {lengths}")
        chained = cls.chain(metric_lists)
        if chained.weighted or chained.aggregation in (AggregationType.MIN, AggregationType.MAX):
            return chained.aggregate()
        per_position = np.mean(np.array([m.values for m in metric_lists], dtype=float), axis=0)
        return float(_NUMPY_REDUCE[chained.aggregation](per_position))

    @classmethod
    def chain(cls, metric_lists: Iterable[Metric]) -> Metric:
        """One Metric with every value (an empty MEAN Metric when given none)."""
        metric_lists = list(metric_lists)
        if not metric_lists:
            return cls(AggregationType.MEAN)
        chained = cls(metric_lists[0].aggregation)
        for metric in metric_lists:
            chained.extend(metric)
        return chained

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], aggregation: str | AggregationType
    ) -> dict[str, Metric]:
        """One Metric per key, all with ``aggregation``."""
        return {key: cls(aggregation, value) for key, value in data.items()}

    def init_list(self) -> Metric:
        """An empty Metric with this one's aggregation."""
        return Metric(self.aggregation)

    # -- the way out: rlmetrics states ---------------------------------------------
    def to_state(self) -> MetricState:
        """This Metric as a mergeable rlmetrics state (kind mean, sum, min or max)."""
        tracker = Tracker()
        kind = get_kind(self.aggregation.value)
        for value, weight in zip(self.values, self.weights, strict=True):
            if kind.name != "mean":  # SUM, MIN and MAX: a weight only selects (> 0)
                weight = float(weight > 0)
            tracker.log("m", float(value), weight, kind=kind.name)
        state = tracker.state().metrics.get("m")
        if state is None:  # nothing logged: the kind's empty state
            state = MetricState(
                kind.name, (0.0,) * kind.num_sums, (-math.inf,) * kind.num_maxes, None
            )
        return state

    @classmethod
    def from_state(cls, state: MetricState) -> Metric:
        """A Metric with one value summarising ``state`` (a MEAN one keeps its weight).

        Raises:
            ValueError: the state's kind is not mean, sum, min or max.
        """
        try:
            aggregation = AggregationType(state.kind)
        except ValueError:
            raise ValueError(
                f"a Metric holds kinds mean, sum, min or max, not {state.kind!r}"
            ) from None
        metric = cls(aggregation)
        result = result_of(get_kind(state.kind), state)
        if result is not None:
            weight = state.sums[1] if aggregation is AggregationType.MEAN else 1.0
            metric.append(result[""], weight=weight)
        return metric

    def __repr__(self) -> str:
        return f"Metric({self.aggregation.value!r}, values={self.values!r})"


def _state_value(state: MetricState) -> float:
    result = result_of(get_kind(state.kind), state)
    if result is None:
        return 0.0 if state.kind == "sum" else math.nan
    return float(result[""])


def to_tracker_state(metrics: Mapping[str, Metric]) -> TrackerState:
    """A dict of Metrics as one TrackerState (merge workers' states, then compute)."""
    return TrackerState({key: metric.to_state() for key, metric in metrics.items()})


def from_tracker_state(state: TrackerState) -> dict[str, Metric]:
    """A TrackerState's mean/sum/min/max metrics as Metrics."""
    return {name: Metric.from_state(metric) for name, metric in state.metrics.items()}


def reduce_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Reduce each value of ``metrics`` in place (and return the dict), as verl does.

    A Metric aggregates by its kind. A plain list reduces by the key: "max" in it takes
    the max, else "min" the min, else the mean; an empty list gives NaN. A list holding
    Metric objects (plain values mixed in) aggregates by the Metrics' kind.
    """
    for key, value in metrics.items():
        metrics[key] = _reduce(key, value)
    return metrics


def _reduce(key: str, value: Any) -> float:
    if isinstance(value, Metric):
        return value.aggregate()
    items = _flatten(value)
    found = [item for item in items if isinstance(item, Metric)]
    if found:
        kinds = {m.aggregation for m in found}
        if len(kinds) > 1:
            raise ValueError(
                f"metric {key!r} holds Metrics of kinds {sorted(k.value for k in kinds)}"
            )
        merged = Metric(kinds.pop())
        for item in items:
            merged.append(item)
        return merged.aggregate()
    values = [as_scalar(item) for item in items]
    if not values:
        return math.nan
    if "max" in key:
        return float(np.max(values))
    if "min" in key:
        return float(np.min(values))
    return float(np.mean(values))


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, list | tuple):
        return [item for element in value for item in _flatten(element)]
    if isinstance(value, np.ndarray | torch.Tensor) and value.ndim > 0:
        return list(value.reshape(-1))
    return [value]


def append_to_dict(data: dict[str, Any], new_data: Mapping[str, Any], prefix: str = "") -> None:
    """Append each value of ``new_data`` to ``data``'s list (or Metric) under the key.

    Keys get ``prefix`` unless they start with it. A new key starts as an empty Metric
    of the same kind when the value is a Metric, else as an empty list; a list value
    is extended, anything else appended.
    """
    for key, value in new_data.items():
        new_key = key if key.startswith(prefix) else f"{prefix}{key}"
        if new_key not in data:
            data[new_key] = value.init_list() if isinstance(value, Metric) else []
        if isinstance(value, list):
            data[new_key].extend(value)
        else:
            data[new_key].append(value)


__all__ = [
    "AggregationType",
    "Metric",
    "append_to_dict",
    "as_scalar",
    "from_tracker_state",
    "reduce_metrics",
    "to_tracker_state",
]
