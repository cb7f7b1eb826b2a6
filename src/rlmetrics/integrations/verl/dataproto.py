"""Metrics that travel with verl's ``DataProto`` (verl 0.9.1) and merge when it is collected.

The metrics live in ``meta_info`` under the reserved key ``METRICS_KEY``, as the same
``MetricsField`` that ``rlmetrics.integrations.tensordict`` uses: a set of contributions (a
``TrackerState`` each, with a unique id). Reading them merges the distinct
contributions, each once, so a contribution that several pieces of a batch share is
never counted twice.

verl copies ``meta_info`` (by reference) to every piece its operations make (chunk,
split, slice, select, select_idxs, repeat, padding, indexing), so every piece carries the
batch's contributions; they count once when the pieces come back together. The
operations that *combine* DataProtos need more: ``DataProto.concat`` and
``DataProto.union`` assert that a ``meta_info`` key holds equal values everywhere,
which two ranks' different metrics are not. ``MetricsDataProto`` is a ``DataProto``
whose ``concat`` and ``union`` unite the contributions instead. verl's collect functions
(``collect_dp_compute_data_proto``, ``collect_nd_compute_dataproto``) concatenate
outputs with ``type(outputs[0]).concat``, so ranks that return a ``MetricsDataProto``
(``attach_metrics`` returns one) reach the driver as one DataProto carrying the merged
metrics, through verl's own functions, unchanged. One verl method is replaced, by the
integration's ``enable()`` (undone by ``disable()``): ``DataProtoFuture.get``, which
concatenates ``blocking=False`` calls' outputs with ``DataProto.concat`` itself
(``merge_futures``).

A worker::

    out = attach_metrics(DataProto.from_dict({...}), tracker)   # a MetricsDataProto

and the driver::

    output = worker_group.compute_something(batch)   # collected by verl
    get_metrics(output).compute()                     # the exact global numbers
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import verl
from verl.protocol import DataProto, DataProtoFuture

from rlmetrics.integrations.tensordict import METRICS_KEY, MetricsField
from rlmetrics.integrations.verl._version import check_version
from rlmetrics.state import TrackerState
from rlmetrics.tracker import Tracker

check_version(verl.__version__)


class MetricsDataProto(DataProto):
    """A ``DataProto`` whose ``concat`` and ``union`` merge the metrics they carry.

    Every other operation is verl's; those that build a new DataProto with
    ``type(self)`` (chunk, split, slice, select, select_idxs, repeat, concat) return a
    ``MetricsDataProto`` too. ``pop`` returns a plain ``DataProto``, as in verl.
    """

    @staticmethod
    def concat(data: list[DataProto]) -> DataProto:
        """``DataProto.concat`` whose metrics are the union of the pieces' (see ``concat``)."""
        return concat(data)

    def union(self, other: DataProto) -> DataProto:
        """``DataProto.union`` (in place), with the metrics of both united, not compared."""
        fields = [f for f in (metrics_field(self), metrics_field(other)) if f is not None]
        mine = self.meta_info.pop(METRICS_KEY, None)
        try:
            super().union(_without_field(other))
        except BaseException:
            if mine is not None:
                self.meta_info[METRICS_KEY] = mine
            raise
        if fields:
            self.meta_info[METRICS_KEY] = fields[0].union(*fields[1:])
        return self


def attach_metrics(
    data: DataProto, metrics: Tracker | TrackerState | DataProto
) -> MetricsDataProto:
    """``data`` as a ``MetricsDataProto`` carrying ``metrics`` (replacing any it carried).

    ``data``'s batch and non-tensor batch are shared, not copied; its ``meta_info`` is
    copied first, since verl shares one ``meta_info`` dict among the pieces of a chunk.
    A Tracker (snapshotted with ``state()``, no reset) or a TrackerState becomes one new
    contribution; a DataProto passes on the contributions it carries, as they are.

    Args:
        data: the DataProto to carry the metrics (a rank's output).
        metrics: a Tracker, a TrackerState, or a DataProto carrying metrics.
    """
    if not isinstance(data, DataProto):
        raise TypeError(f"attach_metrics: data must be a DataProto, got {type(data).__name__}")
    if isinstance(metrics, DataProto):
        source = metrics_field(metrics)
        field = MetricsField(() if source is None else source.parts)
    else:
        state = metrics.state() if isinstance(metrics, Tracker) else metrics
        if not isinstance(state, TrackerState):
            raise TypeError(
                "attach_metrics: metrics must be a Tracker, TrackerState or DataProto, got "
                f"{type(metrics).__name__}"
            )
        field = MetricsField.new(state)
    meta_info = {**data.meta_info, METRICS_KEY: field}
    if isinstance(data, MetricsDataProto):
        data.meta_info = meta_info
        return data
    return MetricsDataProto(
        batch=data.batch, non_tensor_batch=data.non_tensor_batch, meta_info=meta_info
    )


def metrics_field(data: DataProto) -> MetricsField | None:
    """The raw metrics entry of ``data`` (None when it carries none)."""
    value = data.meta_info.get(METRICS_KEY)
    if value is None or isinstance(value, MetricsField):
        return value
    raise TypeError(
        f"meta_info[{METRICS_KEY!r}] is reserved for rlmetrics, but holds {type(value).__name__}"
    )


def get_metrics(data: DataProto) -> TrackerState:
    """The metrics ``data`` carries, merged (an empty TrackerState when it carries none)."""
    field = metrics_field(data)
    return TrackerState() if field is None else field.state()


def concat(data: Sequence[DataProto]) -> DataProto:
    """``DataProto.concat`` of ``data``, carrying every distinct contribution of the pieces.

    Rows are concatenated and the other ``meta_info`` keys merged by verl, as always;
    the result has the type of the first piece. Works on plain DataProtos too.
    """
    data = list(data)
    fields = [f for f in map(metrics_field, data) if f is not None]
    result = DataProto.concat([_without_field(d) for d in data])
    if fields:
        result.meta_info[METRICS_KEY] = MetricsField(fields[0].union(*fields[1:]).parts)
    return result


def merge_futures(enabled: bool = True) -> None:
    """Make ``DataProtoFuture.get`` concatenate with ``concat`` (on), or verl's (off).

    The one patch of this module, made by the integration's ``enable()`` and undone by
    ``disable()``: for a ``blocking=False`` call verl's collect functions return a
    ``DataProtoFuture``, whose ``get`` concatenates the ranks' outputs with
    ``DataProto.concat`` itself, not with the outputs' type, and so would raise on two
    ranks' different metrics. The replacement gives the same DataProto when no output
    carries metrics. Idempotent.
    """
    if enabled and "get" not in _ORIGINAL_FUTURE:
        _ORIGINAL_FUTURE["get"] = DataProtoFuture.get
        DataProtoFuture.get = _future_get
    elif not enabled and "get" in _ORIGINAL_FUTURE:
        DataProtoFuture.get = _ORIGINAL_FUTURE.pop("get")


_ORIGINAL_FUTURE: dict[str, Any] = {}


def _future_get(self: DataProtoFuture) -> Any:
    """verl 0.9.1's ``DataProtoFuture.get``, concatenating DataProtos with ``concat``."""
    import ray

    output = ray.get(self.futures)
    if output and all(isinstance(o, DataProto) for o in output):
        merged = concat(output)
    else:
        from tensordict import TensorDict
        from verl.utils.tensordict_utils import concat_tensordict

        if not output or not all(isinstance(o, TensorDict) for o in output):
            kinds = sorted({type(o).__name__ for o in output})
            raise TypeError(f"DataProtoFuture.get: cannot concatenate outputs of types {kinds}")
        merged = concat_tensordict(output)
    return merged if self.dispatch_fn is None else self.dispatch_fn(merged)


def _without_field(data: DataProto) -> DataProto:
    """``data`` (same type, shared batches) without the metrics entry in ``meta_info``."""
    if METRICS_KEY not in data.meta_info:
        return data
    meta_info = {k: v for k, v in data.meta_info.items() if k != METRICS_KEY}
    return type(data)(batch=data.batch, non_tensor_batch=data.non_tensor_batch, meta_info=meta_info)


__all__ = [
    "METRICS_KEY",
    "MetricsDataProto",
    "attach_metrics",
    "concat",
    "get_metrics",
    "merge_futures",
    "metrics_field",
]
