"""TrackerState: the picklable snapshot that moves between processes, and its merge."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlmetrics._engine.packing import ReducedStep
from rlmetrics.errors import MalformedStateError
from rlmetrics.kinds import Dist, Kind, MetricState, QuantileSketch, get_kind
from rlmetrics.kinds.base import carries_extra, result_of
from rlmetrics.kinds.dist import as_array
from rlmetrics.kinds.extra import ExtraKind

STATE_VERSION = 2
"""The ``to_dict`` format, the one ``from_dict`` reads. A user kind's extra keeps its
python types (a list, a dict, a set, a numpy array inside it). Version 1, which
rewrote them, was never released."""
_STATE_KEYS = frozenset({"version", "metrics"})
_REQUIRED_METRIC_KEYS = ("kind", "sums", "maxes")
_METRIC_KEYS = frozenset({*_REQUIRED_METRIC_KEYS, "extra", "num_nonfinite", "fingerprint"})


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
                merged[name] = merged_metric(name, mine, metric, get_kind(mine.kind))
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
        reduced = ReducedStep.from_states(
            self.metrics, lambda name: own.get(name) or get_kind(name)
        )
        return reduced.results(empty=empty)

    def to_dict(self) -> dict[str, Any]:
        """Plain python (JSON-friendly except numpy arrays) for checkpoints.

        A ``dist`` extra is written as one list of floats; any other kind's extra keeps
        its python types (tuples, lists, dicts, sets, frozensets, numpy arrays and
        scalars, nested, are written as JSON-friendly lists and tagged dicts; any other
        object is kept as it is, for pickle or ``torch.save``), so ``from_dict`` gives
        back an equal extra."""
        return {
            "version": STATE_VERSION,
            "metrics": {
                name: {
                    "kind": m.kind,
                    "sums": list(m.sums),
                    "maxes": list(m.maxes),
                    "extra": _extra_to_plain(m.kind, m.extra),
                    "num_nonfinite": m.num_nonfinite,
                    "fingerprint": m.fingerprint,
                }
                for name, m in self.metrics.items()
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "state_dict") -> TrackerState:
        """Inverse of ``to_dict``: every key and value is checked first.

        Args:
            data: a ``to_dict()``.
            where: what ``data`` is called in error messages.

        Raises:
            MalformedStateError: naming the key (and so the metric) that is missing,
                unknown or of the wrong type, or the unsupported version.
        """
        _expect(isinstance(data, Mapping), where, f"expected a dict, got {_type(data)}")
        version = data.get("version")
        if type(version) is not int or version != STATE_VERSION:
            raise MalformedStateError(
                f"malformed {where}['version']: unsupported TrackerState version "
                f"{version!r} (expected {STATE_VERSION})"
            )
        _no_unknown_keys(data, _STATE_KEYS, where)
        raw = data.get("metrics")
        if not isinstance(raw, Mapping):
            raise MalformedStateError(
                f"malformed {where}['metrics']: expected a dict, got {_type(raw)}"
            )
        metrics = {}
        for name, m in raw.items():
            at = f"{where}['metrics'][{name!r}]"
            _expect(isinstance(name, str) and name, at, "a metric name must be a non-empty str")
            _expect(isinstance(m, Mapping), at, f"expected a dict, got {_type(m)}")
            missing = [key for key in _REQUIRED_METRIC_KEYS if key not in m]
            _expect(not missing, at, f"missing keys {missing}")
            _no_unknown_keys(m, _METRIC_KEYS, at)
            kind = m["kind"]
            _expect(
                isinstance(kind, str) and kind,
                f"{at}['kind']",
                f"expected a kind name, got {kind!r}",
            )
            nonfinite = m.get("num_nonfinite", 0.0)
            _expect(
                _is_real(nonfinite) and nonfinite >= 0,
                f"{at}['num_nonfinite']",
                f"expected a number >= 0, got {nonfinite!r}",
            )
            fingerprint = m.get("fingerprint", "")
            _expect(
                isinstance(fingerprint, str),
                f"{at}['fingerprint']",
                f"expected a str, got {_type(fingerprint)}",
            )
            metrics[name] = MetricState(
                kind,
                _numbers(m["sums"], f"{at}['sums']"),
                _numbers(m["maxes"], f"{at}['maxes']"),
                _extra_from_plain(kind, m.get("extra"), f"{at}['extra']"),
                float(nonfinite),
                fingerprint,
            )
        return cls(metrics)


def merged_metric(name: str, a: MetricState, b: MetricState, kind: Kind) -> MetricState:
    """``a.merge(b)``, raising a ``ValueError`` naming the metric ``name`` for anything
    the merge raises (a user kind's ``merge_extra`` may raise anything)."""
    try:
        return a.merge(b, kind)
    except Exception as error:
        raise ValueError(f"metric {name!r}: {type(error).__name__}: {error}") from error


def merged_extra(name: str, extra: Any, loaded: Any, kind: ExtraKind) -> Any:
    """``kind.merge_extra(extra, loaded)``: what a merge does with a metric's extra,
    raising a ``ValueError`` naming the metric ``name`` for anything it raises."""
    try:
        return kind.merge_extra(extra, loaded)
    except Exception as error:
        raise ValueError(
            f"metric {name!r}: its {kind.name!r} extra {loaded!r:.200} does not merge "
            f"({type(error).__name__}: {error})"
        ) from None


def check_metric(name: str, metric: object, kind: Kind) -> None:
    """Check that ``metric`` can merge into a metric called ``name`` of ``kind``: its
    slot counts, the configuration it was made with and its extra (the numbers of a
    fixed-length one, such as std's triples; the kind's ``check_extra``), so that a
    merge either applies whole or changes nothing.

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
    if not carries_extra(kind):
        return
    empty, extra = kind.empty_extra(), metric.extra
    # a fixed-length tuple of numbers (std's triples); an empty one may grow (a user's)
    if (
        isinstance(empty, tuple)
        and empty
        and not (
            isinstance(extra, tuple | list)
            and len(extra) == len(empty)
            and all(map(_is_real, extra))
        )
    ):
        raise ValueError(
            f"metric {name!r}: a {kind.name!r} state's extra holds {len(empty)} numbers, "
            f"got {extra!r:.200}"
        )
    try:
        kind.check_extra(extra)
    except ValueError as error:
        raise ValueError(f"metric {name!r}: {error}") from None


def checked_load(
    state: TrackerState, kind_of: Callable[[str], Kind], where: str = "state_dict"
) -> dict[str, Kind]:
    """The kind of each of ``state``'s metrics (``kind_of``: the loading tracker's
    lookup), after checking that each can be loaded: its kind is known, its slots,
    configuration and extra fit the kind (``check_metric``), its extra merges into an
    empty one (what loading it into an empty tracker does), a ``dist``'s values are as
    many as its count, and its kind computes a result from it.

    Raises:
        MalformedStateError: naming the metric and what is wrong.
    """
    kinds = {}
    for name, metric in state.metrics.items():
        at = f"{where}['metrics'][{name!r}]"
        try:
            kind = kind_of(metric.kind)
            check_metric(name, metric, kind)
            if carries_extra(kind):
                merged_extra(name, kind.empty_extra(), metric.extra, kind)
        except (TypeError, ValueError) as error:
            raise MalformedStateError(f"malformed {at}: {error}") from None
        if isinstance(kind, Dist):
            size, count = as_array(metric.extra).size, metric.sums[0]
            _expect(size == count, at, f"a 'dist' state counts {count:g} values but holds {size}")
        try:
            result_of(kind, metric, name)
        except Exception as error:  # a user kind's result may raise anything
            raise MalformedStateError(
                f"malformed {at}: its kind {metric.kind!r} cannot compute it "
                f"({type(error).__name__}: {error})"
            ) from None
        kinds[name] = kind
    return kinds


def _expect(condition: object, where: str, what: str) -> None:
    if not condition:
        raise MalformedStateError(f"malformed {where}: {what}")


def _type(value: object) -> str:
    return type(value).__name__


def _is_real(value: object) -> bool:
    return not isinstance(value, bool | np.bool_) and isinstance(
        value, int | float | np.integer | np.floating
    )


def _no_unknown_keys(data: Mapping[str, Any], known: frozenset[str], where: str) -> None:
    unknown = sorted(map(repr, set(data) - known))
    _expect(not unknown, where, f"unknown keys {', '.join(unknown)} (expected {sorted(known)})")


def _numbers(values: object, where: str) -> tuple[float, ...]:
    if not (isinstance(values, list | tuple) and all(map(_is_real, values))):
        raise MalformedStateError(
            f"malformed {where}: expected a list of numbers, got {values!r:.200}"
        )
    return tuple(float(x) for x in values)


# An extra's python types, written as JSON-friendly data: a plain list is a tuple, a
# dict with one of these sets of keys the tagged type (its first key).
_TAGGED = {"list": list, "set": set, "frozenset": frozenset}
_TAG_KEYS = {
    "dict": {"dict"},
    "ndarray": {"ndarray", "dtype", "shape"},
    "scalar": {"scalar", "dtype"},
    **{tag: {tag} for tag in _TAGGED},
}


def _extra_to_plain(kind: str, extra: Any) -> Any:
    if kind == "dist":  # a list of arrays and floats: one list of floats
        return {"array": as_array(extra).tolist()}
    return _to_plain(extra)


def _to_plain(value: Any) -> Any:
    cls = type(value)
    if cls is tuple:
        return [_to_plain(x) for x in value]
    if cls in (list, set, frozenset):
        return {cls.__name__: [_to_plain(x) for x in value]}
    if cls is dict:
        return {"dict": [[_to_plain(k), _to_plain(v)] for k, v in value.items()]}
    if isinstance(value, np.ndarray | np.generic) and value.dtype.kind in "biufcU":
        if isinstance(value, np.generic):
            return {"scalar": value.tolist(), "dtype": value.dtype.str}
        return {"ndarray": value.tolist(), "dtype": value.dtype.str, "shape": list(value.shape)}
    return value  # None, numbers, strings; other objects as they are


def _extra_from_plain(kind: str, data: Any, where: str) -> Any:
    if type(data) is dict and "array" in data and kind == "dist":
        _expect(set(data) == {"array"}, where, f"unknown keys besides 'array': {sorted(data)}")
        try:
            values = np.asarray(data["array"], dtype=np.float64)
        except (TypeError, ValueError) as error:
            raise MalformedStateError(f"malformed {where}['array']: {error}") from None
        _expect(values.ndim == 1, f"{where}['array']", "expected a flat list of numbers")
        return [values] if values.size else []
    if kind == "dist":
        raise MalformedStateError(
            f"malformed {where}: a 'dist' extra is {{'array': [numbers]}}, got {data!r:.200}"
        )
    return _from_plain(data, where)


def _from_plain(data: Any, where: str) -> Any:
    cls = type(data)
    if cls is list:
        return tuple(_from_plain(x, where) for x in data)
    if cls is not dict:
        return data
    tag = next((key for key in _TAG_KEYS if key in data), None)
    if tag is None or set(data) != _TAG_KEYS[tag]:
        raise MalformedStateError(
            f"malformed {where}: expected a tagged extra (a dict with the keys of one of "
            f"{list(_TAG_KEYS.values())}), got a dict with keys {sorted(map(str, data))}"
        )
    items = data[tag]  # an array's nested lists, or a scalar's number
    _expect(
        isinstance(items, list) or tag in ("ndarray", "scalar"),
        f"{where}[{tag!r}]",
        f"expected a list, got {_type(items)}",
    )
    try:
        if tag == "ndarray":
            return np.asarray(items, dtype=np.dtype(data["dtype"])).reshape(data["shape"])
        if tag == "scalar":
            return np.dtype(data["dtype"]).type(items)
        if tag == "dict":
            return {_from_plain(k, where): _from_plain(v, where) for k, v in items}
        return _TAGGED[tag](_from_plain(x, where) for x in items)
    except MalformedStateError:
        raise
    except (TypeError, ValueError) as error:
        raise MalformedStateError(f"malformed {where}[{tag!r}]: {error}") from None
