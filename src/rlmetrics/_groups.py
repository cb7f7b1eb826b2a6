"""Per-group metrics: one log call, one metric per label (``by=``).

``t.mean("critic/score", scores, weight=mask, by=sources)`` logs, for every label in
``sources``, the elements of that label under ``critic/score/<label>``, exactly as if
each label's elements had been logged alone. Labels give one label per element of the
value, or per row (a shape that begins the value's shape); a single label applies to
the whole call.

Host labels (python sequences, numpy arrays) are grouped at the log call, on the host:
with host values and weights each label's elements are recorded at once; with a tensor
value or weight the split (an index on the tensor's device) waits for the fold. Tensor
labels wait for the fold whole: it finds the labels present with one sort and one
``unique_consecutive`` per call, whose read of the labels is a host sync (the fold runs
at ``compute()``, ``state()`` or when the record passes its memory bound, so the sync
lands there, never at the log call). CPU tensors (values, weights, labels) wait as
copies made at the call (``Tracker.copy_cpu_tensors``); a device tensor changed in place
before the fold raises ``ModifiedInputError``, as any logged device tensor does.

A metric per label is an ordinary metric: ranks that saw different labels agree on the
names through the schema agreement (every rank reports every label seen on any rank),
and once the labels stay the same from step to step the agreed layout fits and no
collective is added.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, cast

import numpy as np
import torch
from torch import Tensor

from rlmetrics._engine.inputs import (
    check_name,
    own_dispatch,
    own_dispatch_error,
    plain_clone,
    tracked,
)
from rlmetrics._engine.record import MetricRecords, Prepared
from rlmetrics.errors import ModifiedInputError
from rlmetrics.kinds import Kind

LABEL_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
"""Tensor dtypes ``by=`` takes (integer labels)."""
HOST_LABEL_TYPES = (np.ndarray, list, tuple, str, int, np.integer)
"""Host ``by=`` types: label arrays and sequences, or one label for the whole call."""

Metrics = list[tuple[str, str]]  # (name, kind name) pairs, before the label suffix
Part = tuple[str, Any, Any]  # a label's name part, its elements' values and weights
LabelledPart = tuple[Metrics, Any, Any]  # a label's metrics (named name/part), values, weights


class Deferred(NamedTuple):
    """A grouped call whose split needs a tensor operation, kept until the fold."""

    metrics: Metrics
    prepared: Prepared
    labels: Tensor | np.ndarray  # tensor labels, or host codes (indices into ``names``)
    names: list[str] | None  # per code, its name part; None for tensor labels
    mapping: Mapping[Any, str] | None
    versions: tuple[tuple[int, torch.Size], ...]  # ``tensor_states`` of value, weight, labels


class Groups:
    """A tracker's grouped calls waiting for its fold (``Tracker._fold``)."""

    def __init__(self) -> None:
        self.pending: list[Deferred] = []
        self.resolving = False  # True while ``resolve`` logs the parts (no nested fold)

    def clear(self) -> None:
        """Drop the waiting calls (the tracker was reset)."""
        self.pending = []

    def log(
        self,
        metrics: Metrics,
        value: Any,
        weight: Any,
        by: Any,
        labels: Any,
        kind_of: Callable[[str], Kind],
        prepare: Callable[[str, Any, Any], Prepared],
        copy: bool,
    ) -> tuple[list[LabelledPart], int]:
        """Split one grouped call into ``metrics``: at once for host labels with host
        data, else kept for the fold. The tracker's ways: ``kind_of`` gives the kind of a
        kind name, ``prepare`` checks a value and weight under its settings
        (``Tracker._prepare``); ``copy``: CPU tensor labels are copied, as its CPU tensors.

        Returns:
            the parts for the tracker to log now (one per label present; empty when the
            call waits for the fold), and the elements and calls kept for the fold (the
            tracker's memory bound counts them).

        Raises:
            TypeError, ValueError: naming the metric: a kind that takes no groups, labels
                of the wrong type or shape, a label that makes no valid metric name.
        """
        name = metrics[0][0]
        for metric, kind_name in metrics:
            check_groupable(check_name(metric), kind_of(kind_name))
        mapping = check_mapping(name, labels)
        prepared = prepare(name, value, weight)
        if isinstance(by, Tensor):
            codes, names = check_label_tensor(name, by), None
            if copy and codes.is_cpu:  # its labels now, as with any CPU tensor
                codes = plain_clone(codes)
        else:
            codes, names = host_codes(name, by, mapping)
        check_shape(name, tuple(codes.shape), prepared.shape)
        on_host = not isinstance(prepared.value, Tensor) and not isinstance(prepared.weight, Tensor)
        if names is not None and on_host:
            parts = split_host(prepared, cast(np.ndarray, codes), names)  # host codes
            return [(labelled(metrics, part), v, w) for part, v, w in parts], 0
        tensors = (prepared.value, prepared.weight, codes)
        versions = tensor_states(tensors)
        self.pending.append(Deferred(metrics, prepared, codes, names, mapping, versions))
        return [], 1 + prepared.size

    def resolve(self, log_parts: Callable[[list[LabelledPart]], None]) -> None:
        """Split every waiting call by label and hand each call's parts to ``log_parts``
        (the tracker's; the fold's first step; a host sync per call with tensor labels).

        Raises:
            ModifiedInputError: a waiting tensor changed in place; those calls are dropped.
            ValueError: a call could not be logged (a label missing from ``labels=``, a
                name already logged as another kind); those calls are dropped. Every
                other call is logged first.
        """
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        modified, errors = [], []
        self.resolving = True
        try:
            with torch.no_grad():
                for call in pending:
                    tensors = (call.prepared.value, call.prepared.weight, call.labels)
                    now = tensor_states(tensors)
                    if now != call.versions:
                        modified.append(call.metrics[0][0])
                        continue
                    try:
                        parts = split_tensor(call)
                        log_parts([(labelled(call.metrics, part), v, w) for part, v, w in parts])
                    except (TypeError, ValueError) as error:
                        errors.append(str(error))
        finally:
            self.resolving = False
        if modified:
            raise ModifiedInputError(
                "tensors logged with by= this step were changed in place before compute(), "
                "so the values they had when logged are gone; log a copy (tensor.clone()). "
                f"Grouped metrics dropped from this step: {', '.join(map(repr, modified))}"
            )
        if errors:
            raise ValueError("grouped log calls dropped at the fold: " + "; ".join(errors))


def labelled(metrics: Metrics, part: str) -> Metrics:
    """``metrics`` with ``/part`` appended to every name."""
    return [(f"{name}/{part}", kind) for name, kind in metrics]


def check_kinds(logged: Mapping[str, MetricRecords], parts: list[LabelledPart]) -> None:
    """Raise before anything is logged when a label's name is already another kind's
    in ``logged`` (the tracker's metrics of the step)."""
    for metrics, _, _ in parts:
        for name, kind in metrics:
            records = logged.get(name)
            if records is not None and records.kind.name != kind:
                raise ValueError(
                    f"metric {name!r} is already logged as kind {records.kind.name!r}; cannot "
                    f"log it as kind {kind!r}"
                )


def check_groupable(name: str, kind: Kind) -> None:
    """Kinds that keep one value per call (``last``) or split calls into parts take no
    ``by=``: a label's elements would not make a call of their own."""
    if kind.keeps_latest or kind.parts != 1:
        why = "keeps one replicated value per call" if kind.keeps_latest else "splits each call"
        raise TypeError(
            f"metric {name!r}: by= does not apply to kind {kind.name!r}, which {why}; log "
            "each group's value under its own name instead"
        )


def check_mapping(name: str, labels: Any) -> Mapping[Any, str] | None:
    """``labels=`` must be None or a mapping from labels to valid name parts."""
    if labels is None:
        return None
    if not isinstance(labels, Mapping):
        raise TypeError(
            f"metric {name!r}: labels= must be a mapping from label to name (e.g. "
            f"{{0: 'gsm8k'}}), got {type(labels).__name__}"
        )
    for label, part in labels.items():
        check_part(name, label, part)
    return labels


def check_part(name: str, label: Any, part: Any) -> str:
    """A label's name part must be a non-empty printable string that neither starts nor
    ends with '/' and holds no '//' (the metric's name is ``name/part``)."""
    if not isinstance(part, str):
        raise TypeError(
            f"metric {name!r}: label {label!r} names no metric: expected a string, got "
            f"{type(part).__name__} {part!r}"
        )
    if not part or not part.isprintable() or part[0] == "/" or part[-1] == "/" or "//" in part:
        raise ValueError(
            f"metric {name!r}: label {label!r} makes an invalid metric name {name + '/' + part!r}"
            " (a label must be non-empty and printable, with no leading, trailing or double '/')"
        )
    return part


def label_part(name: str, label: Any, mapping: Mapping[Any, str] | None) -> str:
    """The name part of one label (a python str or int): its mapping entry, or itself."""
    if mapping is not None:
        if label not in mapping:
            raise ValueError(
                f"metric {name!r}: label {label!r} is not in labels= (which maps "
                f"{sorted(mapping, key=repr)!r})"
            )
        return mapping[label]
    if isinstance(label, bool) or not isinstance(label, str | int):
        raise TypeError(
            f"metric {name!r}: labels must be strings or integers, got "
            f"{type(label).__name__} {label!r}"
        )
    return check_part(name, label, str(label))


def host_codes(name: str, by: Any, mapping: Mapping[Any, str] | None) -> tuple[np.ndarray, list]:
    """Host labels as codes (int64, the labels' shape) and each code's name part."""
    if not isinstance(by, HOST_LABEL_TYPES) or isinstance(by, bool):
        raise TypeError(
            f"metric {name!r}: by= must be a sequence or numpy array of labels (strings or "
            f"integers), or an integer tensor; got {type(by).__name__}"
        )
    if isinstance(by, list | tuple) or (isinstance(by, np.ndarray) and by.dtype == object):
        check_label_types(name, by)
    array = np.asarray(by)
    if array.size == 0:  # no element, no label (an empty list is a float64 array)
        return np.zeros(array.shape, dtype=np.int64), []
    if array.dtype.kind not in "iuUO":
        raise TypeError(
            f"metric {name!r}: labels must be strings or integers, got labels of dtype "
            f"{array.dtype}"
        )
    try:
        uniques, codes = np.unique(array, return_inverse=True)
    except TypeError as error:  # an object array mixing types numpy cannot order
        raise TypeError(
            f"metric {name!r}: labels must be strings or integers, all of one type ({error})"
        ) from error
    parts = [
        label_part(name, label.item() if isinstance(label, np.generic) else label, mapping)
        for label in uniques
    ]
    return codes.reshape(array.shape).astype(np.int64, copy=False), parts


def _label_type(kind: type) -> str | None:
    """What a python label's type is as a label (numpy's scalars too): "string",
    "integer", or None (floats, bools, None and anything else name no metric)."""
    if issubclass(kind, str):  # np.str_ too
        return "string"
    if issubclass(kind, int | np.integer) and not issubclass(kind, bool | np.bool_):
        return "integer"
    return None


def check_label_types(name: str, by: list | tuple | np.ndarray) -> None:
    """Python labels (a list, tuple or object array) must be all strings or all integers.
    Checked before numpy converts them: it would make ``["gsm8k", 1]`` or ``["gsm8k",
    2.5]`` strings ("2.5" naming a metric) and ``[1, True]`` integers.

    Raises:
        TypeError: naming the metric and the first label of another or a wrong type.
    """
    flat = by.ravel().tolist() if isinstance(by, np.ndarray) else by
    types = set(map(type, flat))
    if len(types) == 1 and (str in types or int in types):
        return
    if types & {list, tuple, np.ndarray}:  # labels per element of a (B, T) value
        flat = np.asarray(by, dtype=object).ravel().tolist()
        types = set(map(type, flat))
    kinds = {kind: _label_type(kind) for kind in types}
    if None not in kinds.values() and len(set(kinds.values())) <= 1:
        return
    first = _label_type(type(flat[0]))
    bad = next(label for label in flat if first is None or kinds[type(label)] != first)
    if kinds[type(bad)] is None:
        got = f"{type(bad).__name__} {bad!r}"
    else:
        got = f"{type(flat[0]).__name__} {flat[0]!r} and {type(bad).__name__} {bad!r}"
    raise TypeError(
        f"metric {name!r}: labels must be strings or integers, all of one type (not "
        f"floats, bools or None); got {got}"
    )


def tensor_states(items: tuple[Any, ...]) -> tuple[tuple[int, torch.Size], ...]:
    """The version counter and shape of each tensor among ``items``: a waiting call's
    tensors must keep both until the fold (``tensor.data = other`` changes the shape and
    leaves the version)."""
    return tuple((t._version, t.shape) for t in items if isinstance(t, Tensor))


def check_label_tensor(name: str, by: Tensor) -> Tensor:
    """Tensor labels must be a dense integer tensor (not bool: a mask is a weight)."""
    if by.dtype not in LABEL_DTYPES or by.layout is not torch.strided or by.is_nested:
        raise TypeError(
            f"metric {name!r}: a by= tensor must be a dense integer tensor, got dtype "
            f"{by.dtype} ({by.layout}{', nested' if by.is_nested else ''})"
        )
    if by.is_meta:
        raise TypeError(f"metric {name!r}: a by= tensor must hold data, got a meta tensor")
    if own_dispatch(by):
        raise TypeError(own_dispatch_error(name, by, "a by= tensor"))
    return tracked(by)  # an integer tensor never requires grad: no detach needed


def check_shape(name: str, labels: tuple[int, ...], value: tuple[int, ...]) -> None:
    """Labels give one label per element (the value's shape), per row (a shape that
    begins the value's shape) or one for all (a single label)."""
    if labels != value[: len(labels)]:
        raise ValueError(
            f"metric {name!r}: by= has shape {labels} but the value has shape {value}; give "
            "one label per element, one per row (a shape the value's shape begins with) or "
            "a single label"
        )


def split_host(prepared: Prepared, codes: np.ndarray, names: list[str]) -> list[Part]:
    """(name part, value, weight) per label present, from host data."""
    if prepared.value is None:  # one number, one label
        return [(names[int(codes.reshape(-1)[0])], prepared.number, prepared.weight_number)]
    if not names:  # an empty call
        return []
    flat, width = codes.reshape(-1), _width(codes.shape, prepared.shape)
    order = _element_order(np.argsort(flat, kind="stable"), width)
    bounds = np.cumsum(np.bincount(flat, minlength=len(names)) * width)[:-1]
    value = np.asarray(prepared.value)  # a copied 0-d tensor is a python float
    values = np.split(value.reshape(-1)[order], bounds)
    weight = prepared.weight
    if isinstance(weight, np.ndarray):
        weight = weight.reshape(-1)[order]
        if not prepared.check_weights:  # a bool mask stays one (no data check at the fold)
            weight = weight.astype(bool)
        weights: list[Any] = np.split(weight, bounds)
    else:
        weights = [weight] * len(names)
    parts = zip(names, values, weights, strict=True)
    return [(part, v, w) for part, v, w in parts if v.size]


def split_tensor(call: Deferred) -> list[Part]:
    """A waiting call's (name part, value, weight) per label present, by index on the
    value's device; tensor labels are read to the host here (a sync)."""
    prepared, labels, names = call.prepared, call.labels, call.names
    value, weight = prepared.value, prepared.weight
    device = next(t.device for t in (value, weight, labels) if isinstance(t, Tensor))
    if value is None:  # a python number with tensor labels
        value = torch.tensor(prepared.number, dtype=torch.float64, device=device)
    elif type(value) is float:  # a copied 0-d tensor
        value = torch.tensor(value, dtype=torch.float64, device=device)
    value = _tensor_of(value, device)
    width = _width(tuple(labels.shape), prepared.shape)
    if names is None:  # tensor labels: sorted, then read (the sync)
        sorted_labels, row_order = torch.sort(cast(Tensor, labels).reshape(-1), stable=True)
        uniques, counts = torch.unique_consecutive(sorted_labels, return_counts=True)
        parts = [label_part(call.metrics[0][0], label, call.mapping) for label in uniques.tolist()]
        sizes = [count * width for count in counts.tolist()]
    else:  # host codes: sorted and counted on the host
        flat = labels.reshape(-1)
        row_order = torch.from_numpy(np.argsort(flat, kind="stable")).to(device)
        counts = np.bincount(flat, minlength=len(names)).tolist()
        parts = [part for part, count in zip(names, counts, strict=True) if count]
        sizes = [count * width for count in counts if count]
    order = _element_order(row_order, width)
    values = value.reshape(-1).index_select(0, order).split(sizes)
    if isinstance(weight, np.ndarray | Tensor):
        weight = _tensor_of(weight, device).reshape(-1).index_select(0, order)
        weights = weight.split(sizes)
    else:
        weights = [prepared.weight_number if prepared.value is None else weight] * len(sizes)
    return list(zip(parts, values, weights, strict=True))


def _tensor_of(record: Any, device: torch.device) -> Tensor:
    """A prepared value or weight as a tensor on ``device``. A read-only array (a CPU
    tensor's copy, ``rlmetrics._engine.copies``) is copied first: torch makes no tensor
    that shares read-only memory."""
    if isinstance(record, np.ndarray) and not record.flags.writeable:
        record = record.copy()
    return torch.as_tensor(record, device=device)


def _width(labels: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """Elements per label: the product of the value's dimensions past the labels'."""
    return math.prod(shape[len(labels) :])


def _element_order(row_order: Any, width: int) -> Any:
    """The element indices of the rows (of ``width`` contiguous elements each) taken in
    ``row_order`` (numpy or torch): sorting rows costs less than sorting elements."""
    if width == 1:
        return row_order
    if isinstance(row_order, Tensor):
        columns = torch.arange(width, device=row_order.device)
    else:
        columns = np.arange(width)
    return (row_order[:, None] * width + columns).reshape(-1)
