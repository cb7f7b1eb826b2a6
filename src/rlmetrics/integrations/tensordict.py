"""Metrics that travel with the data: a TrackerState carried by a TensorDict batch.

The metrics live under one reserved non-tensor key, ``METRICS_KEY``, as a
``MetricsField``: a set of *contributions*, each a ``TrackerState`` with a unique id.
Reading them (``get_metrics``) merges the distinct contributions with
``TrackerState.merge``, the one merge of the package. Because a contribution is
counted once however many pieces of a batch carry it, the operations tensordict
applies on its own (split copies the entry to every piece, clone copies it, indexing
shares it) never count metrics twice; concatenation is a union.

A controller uses four calls (the native tensordict operations are described in
``docs/tensordict.md``)::

    shards = dispatch(batch, num_workers)            # metrics on the first shard only
    # worker: out = ...; attach_metrics(out, tracker) (replica=True on TP/PP copies)
    batch = collect(outputs)                         # rows concatenated, metrics merged
    get_metrics(batch).compute()                     # the exact global numbers
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

try:
    import torch
    from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase
except ImportError as error:  # tensordict is an optional extra
    raise ImportError(
        "rlmetrics.integrations.tensordict needs the tensordict package: pip install "
        "'rlmetrics[tensordict]'"
    ) from error

from rlmetrics.state import TrackerState
from rlmetrics.tracker import Tracker

METRICS_KEY = "_rlmetrics"
"""The reserved key of the metrics entry."""


class MetricsField:
    """The value stored under ``METRICS_KEY``: contributions (id, state), in order.

    Two fields are equal when they hold the same contributions, so tensordict keeps one
    copy when it concatenates pieces of the same batch. Immutable.

    Attributes:
        parts: (contribution id, TrackerState) pairs, first seen first.
        replica: True on the output of a replica worker (``collect`` leaves it out).
    """

    __slots__ = ("parts", "replica")
    parts: tuple[tuple[str, TrackerState], ...]
    replica: bool

    def __init__(self, parts: Sequence[tuple[str, TrackerState]], replica: bool = False) -> None:
        object.__setattr__(self, "parts", tuple(parts))
        object.__setattr__(self, "replica", bool(replica))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("MetricsField is immutable")

    @classmethod
    def new(cls, state: TrackerState, replica: bool = False) -> MetricsField:
        """One new contribution."""
        return cls([(uuid.uuid4().hex, state)], replica)

    def ids(self) -> frozenset[str]:
        """The contribution ids."""
        return frozenset(cid for cid, _ in self.parts)

    def union(self, *others: MetricsField) -> MetricsField:
        """Every distinct contribution of ``self`` and ``others``, in first-seen order."""
        parts = dict(self.parts)
        for other in others:
            for cid, state in other.parts:
                parts.setdefault(cid, state)
        return MetricsField(list(parts.items()), self.replica)

    def state(self) -> TrackerState:
        """The contributions merged (``TrackerState.merge``, in order)."""
        return TrackerState.merge_all([state for _, state in self.parts])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MetricsField):
            return NotImplemented
        return self.replica == other.replica and self.ids() == other.ids()

    def __hash__(self) -> int:
        return hash((self.ids(), self.replica))

    def __reduce__(self) -> tuple:
        return (MetricsField, (self.parts, self.replica))

    def __repr__(self) -> str:
        names = sorted({name for _, s in self.parts for name in s.metrics})
        flag = ", replica" if self.replica else ""
        return f"MetricsField({len(self.parts)} contribution(s), metrics={names}{flag})"


def attach_metrics(
    td: TensorDictBase,
    metrics: Tracker | TrackerState | TensorDictBase,
    *,
    replica: bool = False,
) -> TensorDictBase:
    """Store ``metrics`` on ``td`` (in place), replacing any it carried; returns ``td``.

    A Tracker (snapshotted with ``state()``: one host transfer, no reset) or a
    TrackerState becomes one new contribution. A TensorDict passes on the metrics it
    carries as they are (the same contributions), so ``collect([a, b])`` after
    ``attach_metrics(b, a)`` counts them once.

    Args:
        td: the batch, with any batch size.
        metrics: a Tracker, a TrackerState, or a TensorDict carrying metrics.
        replica: mark ``td`` as a replica worker's output (a tensor- or
            pipeline-parallel copy): ``collect`` leaves it out.
    """
    if isinstance(metrics, TensorDictBase):
        source = metrics_field(metrics)
        parts = () if source is None else source.parts
        _set_field(td, MetricsField(parts, replica))
        return td
    state = metrics.state() if isinstance(metrics, Tracker) else metrics
    if not isinstance(state, TrackerState):
        raise TypeError(
            "attach_metrics expects a Tracker, TrackerState or TensorDict, got "
            f"{type(metrics).__name__}"
        )
    _set_field(td, MetricsField.new(state, replica))
    return td


def get_metrics(td: TensorDictBase) -> TrackerState:
    """The metrics ``td`` carries, merged (an empty TrackerState when it carries none).

    Works on batches made by tensordict's own operations too: after ``torch.cat`` or
    ``torch.stack`` the entry holds one field per row, and the distinct contributions
    are merged, each once.
    """
    field = metrics_field(td)
    return TrackerState() if field is None else field.state()


def metrics_field(td: TensorDictBase) -> MetricsField | None:
    """The raw metrics entry of ``td`` (None when absent), rows' fields united."""
    entry = td.get(METRICS_KEY, None)
    if entry is None:
        return None
    fields = list(_fields(entry))
    if not fields:  # a stack form with zero rows
        return None
    return fields[0].union(*fields[1:])


def is_replica(td: TensorDictBase) -> bool:
    """Whether ``td`` was marked as a replica worker's output."""
    field = metrics_field(td)
    return field is not None and field.replica


def dispatch(td: TensorDictBase, num_workers: int) -> list[TensorDictBase]:
    """Shard ``td`` along its first batch dimension into ``num_workers`` pieces.

    Piece sizes differ by at most one (the first pieces are larger, as
    ``np.array_split`` does); pieces may be empty. The metrics go whole to the first
    piece only, so concatenating the pieces (``collect``) gives back the same metrics.
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"dispatch: num_workers must be an int >= 1, got {num_workers!r}")
    if td.batch_dims < 1:
        raise ValueError("dispatch: the batch needs at least one batch dimension to shard")
    field = metrics_field(td)
    rows = td.batch_size[0]
    sizes = [rows // num_workers + (1 if i < rows % num_workers else 0) for i in range(num_workers)]
    pieces = list(td.exclude(METRICS_KEY).split(sizes, dim=0))
    if field is not None:
        _set_field(pieces[0], field)
    return pieces


def collect(
    outputs: Sequence[TensorDictBase], replicas: Sequence[bool] | None = None
) -> TensorDictBase:
    """Concatenate workers' outputs along dim 0, with their metrics merged.

    A replica output (its ``replicas`` entry is True, or it was attached with
    ``replica=True``) is left out whole: its rows and metrics copy its source's. Outputs
    with no batch dimensions and no entries but metrics (a worker that returns metrics
    only) give an empty, unbatched result that carries the merged metrics.

    Args:
        outputs: one TensorDict per worker, in worker (rank) order.
        replicas: one flag per output, True for a replica worker's output.
    """
    if replicas is not None and len(replicas) != len(outputs):
        raise ValueError(f"collect: got {len(outputs)} outputs but {len(replicas)} replica flags")
    flags = replicas if replicas is not None else [False] * len(outputs)
    kept = [out for out, flag in zip(outputs, flags, strict=True) if not (flag or is_replica(out))]
    if not kept:
        raise ValueError(f"collect: no output to collect ({len(outputs)} given, all replicas)")
    fields = [f for f in map(metrics_field, kept) if f is not None]
    data = [out.exclude(METRICS_KEY) for out in kept]
    if all(d.batch_dims == 0 and d.is_empty() for d in data):
        result: TensorDictBase = TensorDict({}, batch_size=[])
    else:
        # TensorDict handles torch.cat (__torch_function__); torch's stubs take Tensors only
        result = torch.cat(data, dim=0)  # type: ignore[arg-type, assignment]
    if fields:
        _set_field(result, MetricsField(fields[0].union(*fields[1:]).parts))
    return result


def update(td: TensorDictBase, other: TensorDictBase, **kwargs: Any) -> TensorDictBase:
    """``td.update(other)`` that merges the metrics of both instead of replacing them.

    Contributions both carry (``other`` derived from ``td``) count once. Keyword
    arguments go to ``TensorDictBase.update``. In place; returns ``td``.
    """
    mine, theirs = metrics_field(td), metrics_field(other)
    td.update(other.exclude(METRICS_KEY), **kwargs)
    fields = [f for f in (mine, theirs) if f is not None]
    if fields:
        _set_field(td, fields[0].union(*fields[1:]))
    return td


def _set_field(td: TensorDictBase, field: MetricsField) -> None:
    if td.get(METRICS_KEY, None) is not None:
        del td[METRICS_KEY]  # a stack form would take the value per row
    td.set_non_tensor(METRICS_KEY, field)


def _fields(entry: Any) -> Iterator[MetricsField]:
    """Every MetricsField inside a non-tensor entry (NonTensorData or a stack)."""
    if isinstance(entry, NonTensorData):
        yield _checked(entry.data)
    elif isinstance(entry, NonTensorStack):
        yield from _flatten(entry.tolist())
    elif isinstance(entry, MetricsField):
        yield entry
    else:
        raise TypeError(
            f"the entry {METRICS_KEY!r} is reserved for rlmetrics, but holds {type(entry).__name__}"
        )


def _flatten(values: Iterable[Any]) -> Iterator[MetricsField]:
    for value in values:
        if isinstance(value, list):  # NonTensorStack.tolist() nests per batch dimension
            yield from _flatten(value)
        else:
            yield _checked(value)


def _checked(value: Any) -> MetricsField:
    if not isinstance(value, MetricsField):
        raise TypeError(
            f"the entry {METRICS_KEY!r} is reserved for rlmetrics, but holds {type(value).__name__}"
        )
    return value


__all__ = [
    "METRICS_KEY",
    "MetricsField",
    "attach_metrics",
    "collect",
    "dispatch",
    "get_metrics",
    "is_replica",
    "metrics_field",
    "update",
]
