"""Step end: every metric's records reduced into its state, one pass per kind and device.

A log call only records its value and weight (``rlmetrics.record``). Here the records
of all metrics of a kind on one backend (host data with numpy; a metric with a tensor
record on that tensor's device) become one ``Batch``, with a number of torch operations
that depends on the kinds, devices and shapes logged but not on how many calls there
were; the framework's rules apply to the whole batch at once (below), then the kind's
``reduce`` makes one state row per metric, which folds into the metric's accumulator.

Rules, the same on every backend:

* An element with weight 0 contributes nothing, whatever its value: its value becomes 0
  before any arithmetic (``NaN * 0`` is NaN).
* A call with a negative or non-finite weight, or (``nonfinite="error"``) a non-finite
  selected value, is rejected whole: it contributes nothing and is counted, and
  ``compute()`` reports it.
* ``nonfinite="skip"`` drops non-finite selected elements and counts them.

A tensor changed in place between its log call and the fold (its version counter moved)
raises ``ModifiedInputError`` naming the metric: its value at the log call is gone.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from itertools import chain
from operator import attrgetter
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlmetrics.kinds.base import Accumulator, Kind
from rlmetrics.kinds.batch import Array, Batch, DeviceBatch, to_device
from rlmetrics.table import Table


class ModifiedInputError(ValueError):
    """A logged tensor was changed in place before the step's end."""


def fold(accs: list[Accumulator], table: Table, nonfinite: str) -> None:
    """Reduce the records of ``accs`` into their rows of ``table``; clear the records.

    Raises:
        ModifiedInputError: a logged tensor changed in place; the records of the metrics
            named are dropped (reported once), every other metric is folded.
    """
    devices: dict[Any, list[_Group]] = {}
    modified: list[str] = []
    for group in _kind_groups(accs, table):
        members = list(filter(_get_values, group.members))
        if not members:
            continue
        if any(map(_get_versions, members)):
            dropped = [acc for acc in members if acc.versions and _modified(acc)]
            for acc in dropped:
                modified.append(acc.name)
                acc.clear_records()
            members = list(filter(_get_values, members))
        record_devices = set(map(_get_record_device, members))
        if len(record_devices) == 1 and len(members) == len(group.members):
            devices.setdefault(record_devices.pop(), []).append(group)
            continue
        for device in record_devices:
            on_device = [acc for acc in members if acc.record_device == device]
            devices.setdefault(device, []).append(_Group(on_device))
    for device, kinds in devices.items():
        if device is None:
            _fold_records(table, device, kinds, nonfinite)
        else:
            with torch.no_grad():
                _fold_records(table, device, kinds, nonfinite)
    if modified:
        raise ModifiedInputError(
            "tensors logged this step were changed in place before compute(), so the "
            "values they had when logged are gone; log a copy (tensor.clone()) or log "
            f"after the change. Metrics dropped from this step: {', '.join(map(repr, modified))}"
        )


_get_values = attrgetter("values")
_get_weights = attrgetter("weights")
_get_versions = attrgetter("versions")
_get_record_device = attrgetter("record_device")
_get_num_arrays = attrgetter("num_arrays")
_get_row = attrgetter("row")
_get_num_checked = attrgetter("num_checked")


class _Group:
    """Metrics of one kind, and (computed once) their rows' positions in the table."""

    def __init__(self, members: list[Accumulator]) -> None:
        self.members = members
        self.kind = members[0].kind
        self._positions: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def positions(self, table: Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The members' rows, and their (rows, slots) SUM and MAX positions."""
        if self._positions is None:
            rows = np.fromiter(map(_get_row, self.members), np.int64, len(self.members))
            self._positions = (rows, *table.positions(rows, self.kind))
        return self._positions


def _kind_groups(accs: list[Accumulator], table: Table) -> list[_Group]:
    """``accs`` grouped by kind object, in order; cached on ``table`` for as long as
    the same accumulators come (a steady-state step)."""
    cached = table.fold_groups
    if cached is not None and cached[0] == accs:  # identity
        return cached[1]
    groups: dict[int, list[Accumulator]] = {}
    for acc in accs:
        groups.setdefault(id(acc.kind), []).append(acc)
    table.fold_groups = (accs, [_Group(members) for members in groups.values()])
    return table.fold_groups[1]


def _modified(acc: Accumulator) -> bool:
    """Whether a tensor record changed in place since its log call (its version counter
    moved); ``versions`` holds, per tensor record in call order, the weight's then the
    value's version at the log call."""
    versions = iter(acc.versions)
    for value, weight in zip(acc.values, acc.weights, strict=True):
        if isinstance(weight, Tensor) and weight._version != next(versions):
            return True
        if isinstance(value, Tensor) and value._version != next(versions):
            return True
    return False


def _fold_records(
    table: Table, device: torch.device | None, groups: list[_Group], nonfinite: str
) -> None:
    """Fold one device's (or the host's) records: one batch for all its metrics, each
    kind reducing its own rows into ``table``."""
    accs = [acc for group in groups for acc in group.members]
    with np.errstate(all="ignore"):  # inf and NaN give what the arithmetic gives
        batch, flags = _batch(accs, device, nonfinite)
        row = element = call = 0
        for group in groups:
            kind, members = group.kind, group.members
            rows = slice(row, row + len(members))
            size = sum(batch.lengths[rows])
            calls = sum(map(len, map(_get_values, members)))
            part = batch.part(rows, slice(element, element + size), slice(call, call + calls))
            row, element, call = rows.stop, element + size, call + calls
            sums, maxes = kind.reduce(part)
            positions = group.positions(table)
            present = None
            if kind.replaces:  # a row with no selected value keeps the old one
                present = (sums != 0).any(1) | (maxes != -math.inf).any(1)
            if batch.on_host:
                table.add(kind, positions, sums, maxes, present)
            else:
                table.add_device(kind, positions, sums, maxes, present)
            if kind.has_extra:
                _fold_extras(table, kind, positions[0], kind.reduce_extra(part), batch.on_host)
        if flags is not None:
            rows_all = np.fromiter(map(_get_row, accs), np.int64, len(accs))
            table.add_counts(rows_all, flags)
    if any(map(_get_num_arrays, accs)):
        for acc in accs:
            acc.clear_records()
    else:  # python numbers only: two lists each
        deque(map(list.clear, map(_get_values, accs)), 0)
        deque(map(list.clear, map(_get_weights, accs)), 0)


def _fold_extras(
    table: Table, kind: Kind, rows: np.ndarray, extras: list[Any], on_host: bool
) -> None:
    if on_host:
        for row, extra in zip(rows.tolist(), extras, strict=True):
            table.extras[row] = kind.merge_extra(table.extras[row], extra)
        return
    dev_extras = table.device_part.extras
    for row, extra in zip(rows.tolist(), extras, strict=True):
        dev_extras[row] = kind.merge_dev_extra(dev_extras.get(row), extra)


def _batch(
    accs: list[Accumulator], device: torch.device | None, nonfinite: str
) -> tuple[Batch, Array | None]:
    """The records of ``accs`` as one screened batch, and per metric its framework counts
    ([non-finite, rejected], None when no call needed a data check)."""
    make = Batch if device is None else DeviceBatch
    if any(map(_get_num_arrays, accs)):
        parts = _Parts()
        for acc in accs:
            parts.add(acc)
        parts.flush()
        call_lengths, lengths = parts.call_lengths, parts.lengths
        values = assemble(parts.values, device)
        weights = assemble(parts.weights, device)
    else:  # python numbers only: one element per call
        lengths = list(map(len, map(_get_values, accs)))
        total = sum(lengths)
        call_lengths = [1] * total
        values = np.array(list(chain.from_iterable(map(_get_values, accs))), np.float64)
        weights = np.array(list(chain.from_iterable(map(_get_weights, accs))), np.float64)
        if device is not None:
            values, weights = to_device(values, device), to_device(weights, device)
    segments = np.repeat(np.arange(len(accs)), lengths)
    batch = make(values, weights, _on(segments, device), lengths, call_lengths)
    checks = nonfinite == "error" or any(map(_get_num_checked, accs))
    flags = None
    zero = 0.0
    if checks or nonfinite == "skip":
        calls = _on(np.repeat(np.arange(len(call_lengths)), call_lengths), device)
        call_rows = np.repeat(np.arange(len(accs)), [len(acc.values) for acc in accs])
        bad = ~((weights >= 0) & (weights < math.inf))  # NaN fails both
        if nonfinite == "error":
            bad = bad | ((weights > 0) & ~batch.isfinite(values))
        call_bad = batch.sum_by(bad * 1.0, calls, len(call_lengths)) > 0
        rejected = batch.sum_by(call_bad * 1.0, _on(call_rows, device), len(accs))
        weights = batch.where(call_bad[calls], zero, weights)
        skipped = rejected * 0.0
        if nonfinite == "skip":
            finite = batch.isfinite(values)
            skipped = batch.sum_by(((weights > 0) & ~finite) * 1.0)
            weights = batch.where(finite, weights, zero)
        flags = batch.columns(skipped, rejected)
    selected = weights > 0
    batch.weights, batch.values = weights, batch.where(selected, values, zero)
    batch._selected = selected
    return batch, flags


class _Parts:
    """Metrics' records as flat parts (host arrays or tensors), metric by metric in call
    order; each run of python numbers, across metrics, becomes one array."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self.weights: list[Any] = []
        self.call_lengths: list[int] = []
        self.lengths: list[int] = []
        self.numbers: list[float] = []
        self.number_weights: list[float] = []

    def add(self, acc: Accumulator) -> None:
        values, weights = acc.values, acc.weights
        if not acc.num_arrays:  # python numbers only: checked when logged, never rejected
            self.numbers += values
            self.number_weights += weights
            self.call_lengths += [1] * len(values)
            self.lengths.append(len(values))
            return
        start = len(self.call_lengths)
        for value, weight in zip(values, weights, strict=True):
            if type(value) is float:
                self.numbers.append(value)
                self.number_weights.append(weight)
                self.call_lengths.append(1)
                continue
            self.flush()
            size = value.numel() if isinstance(value, Tensor) else value.size
            self.values.append(value)
            if weight is None or type(weight) is float:
                self.weights.append(np.full(size, 1.0 if weight is None else weight))
            else:
                self.weights.append(weight)
            self.call_lengths.append(size)
        self.lengths.append(sum(self.call_lengths[start:]))

    def flush(self) -> None:
        """End the current run of python numbers."""
        if self.numbers:
            self.values.append(np.array(self.numbers))
            self.weights.append(np.array(self.number_weights))
            self.numbers, self.number_weights = [], []


def assemble(parts: Sequence[Any], device: torch.device | None) -> Array:
    """Flat parts (host arrays of any shape and real dtype, tensors) as one 1-D float64
    array (``device`` None) or tensor on ``device``, in order.

    Tensors are concatenated by shape class (0-d ones stacked; others by their trailing
    shape), so the number of torch operations depends on the classes, not on the number
    of parts; a permutation restores the order when there are several classes.
    """
    host = [i for i, part in enumerate(parts) if not isinstance(part, Tensor)]
    classes: dict[tuple[Any, ...], list[int]] = {}
    for i, part in enumerate(parts):
        if isinstance(part, Tensor):
            classes.setdefault((part.device, part.dim() == 0, part.shape[1:]), []).append(i)
    blocks: list[Any] = []
    order: list[int] = []
    if host:
        flat = [_flat_host(parts[i]) for i in host]
        blocks.append(np.concatenate(flat) if len(flat) > 1 else flat[0])
        order += host
    target = device or torch.device("cpu")
    for (part_device, scalar, _), members in classes.items():
        tensors = [parts[i] for i in members]
        blocks.append(_tensor_block(tensors, scalar, target, part_device))
        order += members
    if device is None:
        blocks = [b if isinstance(b, np.ndarray) else b.numpy() for b in blocks]
        flat_all = np.concatenate(blocks) if len(blocks) > 1 else blocks[0] if blocks else None
        if flat_all is None:
            return np.zeros(0)
    else:
        blocks = [to_device(b, device) if isinstance(b, np.ndarray) else b for b in blocks]
        if not blocks:
            return torch.zeros(0, dtype=torch.float64, device=device)
        flat_all = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
    if len(blocks) > 1 and order != sorted(order):
        sizes = [_size(parts[i]) for i in order]
        permutation = _permutation(order, sizes)
        flat_all = flat_all[permutation if device is None else _on(permutation, device)]
    return flat_all


def _flat_host(part: np.ndarray) -> np.ndarray:
    if part.ndim == 1 and part.dtype == np.float64:
        return part
    return np.asarray(part, dtype=np.float64).reshape(-1)


def _tensor_block(
    tensors: list[Tensor], scalar: bool, target: torch.device, source: torch.device
) -> Tensor:
    """Tensors of one shape class as one flat float64 tensor on ``target``."""
    if scalar:
        out = torch.empty(len(tensors), dtype=torch.float64, device=source)
        torch.stack(tensors, out=out)
    else:
        rows = sum(t.shape[0] for t in tensors)
        out = torch.empty((rows, *tensors[0].shape[1:]), dtype=torch.float64, device=source)
        torch.cat(tensors, out=out)
        out = out.view(-1)
    return out if source == target else out.to(target)


def _size(part: Any) -> int:
    return part.numel() if isinstance(part, Tensor) else np.size(part)


def _permutation(order: list[int], sizes: list[int]) -> np.ndarray:
    """Where each element of the parts, in their original order, lies in the blocks
    laid out in ``order`` (part indices) with ``sizes`` elements each."""
    sizes_arr = np.asarray(sizes, dtype=np.int64)
    laid_start = np.cumsum(sizes_arr) - sizes_arr
    original = np.argsort(np.asarray(order), kind="stable")  # part i's place in order
    lengths = sizes_arr[original]
    source_start = laid_start[original]
    target_start = np.cumsum(lengths) - lengths
    return np.repeat(source_start - target_start, lengths) + np.arange(int(lengths.sum()))


def _on(array: np.ndarray, device: torch.device | None) -> Array:
    return array if device is None else to_device(array, device)
