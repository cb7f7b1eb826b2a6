"""TrackerState: the picklable snapshot that moves between processes, and its merge."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlmetrics.kinds import Dist, Kind, MetricState, QuantileSketch, get_kind
from rlmetrics.results import Reduced

STATE_VERSION = 1


@dataclass(frozen=True)
class TrackerState:
    """The metrics of one process (or a merge of several): name -> MetricState.

    Small and picklable (plain python floats, tuples and numpy arrays inside). Merging is
    associative and commutative, so states can be combined in any order or tree shape.
    """

    metrics: Mapping[str, MetricState] = field(default_factory=dict)

    def merge(self, other: TrackerState) -> TrackerState:
        """A new state holding both; kinds must agree per name."""
        merged = dict(self.metrics)
        for name, metric in other.metrics.items():
            mine = merged.get(name)
            if mine is None:
                merged[name] = metric
            elif mine.kind != metric.kind:
                raise ValueError(
                    f"metric {name!r} is kind {mine.kind!r} in one state and {metric.kind!r} "
                    "in the other"
                )
            else:
                merged[name] = mine.merge(metric, get_kind(mine.kind))
        return TrackerState(merged)

    @classmethod
    def merge_all(
        cls, states: Sequence[TrackerState], replicas: Sequence[bool] | None = None
    ) -> TrackerState:
        """Merge many states left to right (keep rank order for bit-identical results).

        Args:
            states: one state per worker.
            replicas: one flag per state; True marks a tensor/pipeline-parallel copy
                whose metrics another state already holds, so it is left out.
        """
        if replicas is not None:
            if len(replicas) != len(states):
                raise ValueError(
                    f"replicas has {len(replicas)} entries for {len(states)} states; "
                    "give one flag per state"
                )
            if states and all(replicas):
                raise ValueError("every state is marked as a replica: nothing would be merged")
            states = [s for s, copy in zip(states, replicas, strict=True) if not copy]
        out = cls()
        for state in states:
            if not isinstance(state, TrackerState):
                raise TypeError(f"expected TrackerState, got {type(state).__name__}")
            out = out.merge(state)
        return out

    def compute(
        self, *, empty: str = "omit", quantiles: Sequence[float] | None = None
    ) -> dict[str, float]:
        """The metrics' values, as ``Tracker.compute`` reports them.

        Args:
            empty: "omit" or "nan", as ``Tracker(empty=...)``.
            quantiles: the quantiles ``dist`` metrics report (default: the kind's).
        """
        if empty not in ("omit", "nan"):
            raise ValueError(f"compute(empty=...) must be one of ('omit', 'nan'), got {empty!r}")
        own: dict[str, Kind] = {}
        if quantiles is not None:
            own = {"dist": Dist(quantiles), "quantile": QuantileSketch(quantiles=quantiles)}
        reduced = Reduced.from_states(self.metrics, lambda name: own.get(name) or get_kind(name))
        return reduced.results(empty=empty)

    def to_dict(self) -> dict[str, Any]:
        """Plain python (JSON-friendly except numpy arrays) for checkpoints."""
        return {
            "version": STATE_VERSION,
            "metrics": {
                name: {
                    "kind": m.kind,
                    "sums": list(m.sums),
                    "maxes": list(m.maxes),
                    "extra": _extra_to_plain(m.extra),
                    "num_nonfinite": m.num_nonfinite,
                    "fingerprint": m.fingerprint,
                }
                for name, m in self.metrics.items()
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrackerState:
        """Inverse of ``to_dict``."""
        version = data.get("version")
        if version != STATE_VERSION:
            raise ValueError(f"unsupported TrackerState version {version!r} (expected 1)")
        metrics = {}
        for name, m in data["metrics"].items():
            extra = m.get("extra")
            if isinstance(extra, dict) and "array" in extra:
                extra = [np.asarray(extra["array"], dtype=np.float64)]
            elif isinstance(extra, list):
                extra = tuple(extra)
            metrics[name] = MetricState(
                m["kind"],
                tuple(float(x) for x in m["sums"]),
                tuple(float(x) for x in m["maxes"]),
                extra,
                float(m.get("num_nonfinite", 0.0)),
                str(m.get("fingerprint", "")),
            )
        return cls(metrics)


def check_metric(name: str, metric: object, kind: Kind) -> None:
    """Check that ``metric`` can merge into a metric called ``name`` of ``kind``: its
    slot counts, the configuration it was made with and the shape of its extra, so that
    a merge either applies whole or changes nothing.

    Raises:
        TypeError: ``metric`` is not a ``MetricState``.
        ValueError: naming the metric and what differs.
    """
    if not isinstance(metric, MetricState):
        raise TypeError(f"metric {name!r}: expected a MetricState, got {type(metric).__name__}")
    if len(metric.sums) != kind.num_sums or len(metric.maxes) != kind.num_maxes:
        raise ValueError(
            f"metric {name!r}: a {kind.name!r} state has {kind.num_sums} sum and "
            f"{kind.num_maxes} max slots here, but the merged state has {len(metric.sums)} "
            f"and {len(metric.maxes)}: the kind is configured differently where it was made"
        )
    if metric.fingerprint and metric.fingerprint != kind.fingerprint():
        raise ValueError(
            f"metric {name!r}: kind {kind.name!r} is configured as {kind.fingerprint()!r} "
            f"here but as {metric.fingerprint!r} where the merged state was made"
        )
    empty = kind.empty_extra() if kind.has_extra else None
    if isinstance(empty, tuple) and not (
        isinstance(metric.extra, tuple | list) and len(metric.extra) == len(empty)
    ):
        raise ValueError(
            f"metric {name!r}: a {kind.name!r} state's extra holds {len(empty)} numbers, "
            f"got {metric.extra!r}"
        )


def _extra_to_plain(extra: Any) -> Any:
    if isinstance(extra, list):  # dist: a list of arrays and floats
        from rlmetrics.kinds.dist import as_array

        return {"array": as_array(extra).tolist()}
    if isinstance(extra, tuple):
        return list(extra)
    return extra
