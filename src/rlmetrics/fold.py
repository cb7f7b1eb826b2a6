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
from itertools import accumulate
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from rlmetrics.kinds.base import Accumulator, Kind
from rlmetrics.kinds.batch import Array, Batch, DeviceBatch, to_device
from rlmetrics.record import NumberRecords
from rlmetrics.table import Table


class ModifiedInputError(ValueError):
    """A logged tensor was changed in place before the step's end."""


def fold(accs: list[Accumulator], numbers: NumberRecords, table: Table, nonfinite: str) -> None:
    """Reduce the records of ``accs`` (their own, and the tracker's flat ``numbers``)
    into their rows of ``table``; clear the records.

    Host data folds first, then each device's: a metric's flat numbers were all logged
    before its first tensor record, so a kind that keeps the latest value sees them in
    call order.

    Raises:
        ModifiedInputError: a logged tensor changed in place; the records of the metrics
            named are dropped (reported once), every other metric is folded.
    """
    with_records = list(filter(_get_values, accs))
    modified: list[str] = []
    if any(map(_get_versions, with_records)):
        for acc in with_records:
            if acc.versions and _modified(acc):
                modified.append(acc.name)
                acc.clear_records()
        with_records = list(filter(_get_values, with_records))
    on_device: dict[Any, list[Accumulator]] = {}
    host: list[Accumulator] = []
    for acc in with_records:
        if acc.record_device is None:
            host.append(acc)
        else:
            on_device.setdefault(acc.record_device, []).append(acc)
    if numbers.values or host:
        _fold_records(table, _plan(table, None, accs), numbers, host, None, nonfinite)
        numbers.clear()
    for device, members in on_device.items():
        plan = _plan(table, device, members)
        with torch.no_grad():
            _fold_records(table, plan, None, plan.members, device, nonfinite)
    if any(map(_get_num_arrays, with_records)):
        for acc in with_records:
            acc.clear_records()
    else:  # python numbers only: two lists each
        deque(map(list.clear, map(_get_values, with_records)), 0)
        deque(map(list.clear, map(_get_weights, with_records)), 0)
    if modified:
        raise ModifiedInputError(
            "tensors logged this step were changed in place before compute(), so the "
            "values they had when logged are gone; log a copy (tensor.clone()) or log "
            f"after the change. Metrics dropped from this step: {', '.join(map(repr, modified))}"
        )


_get_values = attrgetter("values")
_get_weights = attrgetter("weights")
_get_versions = attrgetter("versions")
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


class _Plan:
    """The metrics of one fold grouped by kind (``members`` in that order), and where
    each table row's metric is in that order (``index``: -1 for a row not in it)."""

    def __init__(self, accs: list[Accumulator], table: Table) -> None:
        by_kind: dict[int, list[Accumulator]] = {}
        for acc in accs:
            by_kind.setdefault(id(acc.kind), []).append(acc)
        self.groups = [_Group(members) for members in by_kind.values()]
        self.members = [acc for group in self.groups for acc in group.members]
        self.bounds = list(accumulate((len(group.members) for group in self.groups), initial=0))
        self.rows = np.fromiter(map(_get_row, self.members), np.int64, len(self.members))
        self.index = np.full(table.num_rows, -1, dtype=np.int64)
        self.index[self.rows] = np.arange(len(self.rows))
        self._numbers: tuple[list[int], _Layout] | None = None
        self._positions: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}

    def positions(self, groups: list[int], table: Table) -> tuple[np.ndarray, np.ndarray]:
        """The SUM and MAX positions of the rows of ``groups`` (indices into
        ``self.groups``), flat, in order; kept per set of groups."""
        key = tuple(groups)
        cached = self._positions.get(key)
        if cached is None:
            positions = [self.groups[i].positions(table) for i in groups]
            cached = self._positions[key] = (
                np.concatenate([sums.reshape(-1) for _, sums, _ in positions]),
                np.concatenate([maxes.reshape(-1) for _, _, maxes in positions]),
            )
        return cached

    def numbers_layout(self, numbers: NumberRecords) -> _Layout:
        """The layout of the flat ``numbers``; the last one is kept, since a
        steady-state step logs its metrics in the same order every time."""
        cached = self._numbers
        if cached is not None and cached[0] == numbers.rows:
            return cached[1]
        rows = self.index[np.fromiter(numbers.rows, np.int64, len(numbers.rows))]
        layout = _Layout.make(rows, rows, len(self.rows))
        self._numbers = (list(numbers.rows), layout)
        return layout


def _plan(table: Table, device: torch.device | None, accs: list[Accumulator]) -> _Plan:
    """The plan of ``accs`` folding on ``device`` (None: the host), cached on ``table``
    for as long as the same accumulators come (a steady-state step)."""
    cached = table.fold_plans.get(device)
    if cached is not None and cached[0] == accs:  # identity
        return cached[1]
    plan = _Plan(accs, table)
    table.fold_plans[device] = (accs, plan)
    return plan


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
    table: Table,
    plan: _Plan,
    numbers: NumberRecords | None,
    accs: list[Accumulator],
    device: torch.device | None,
    nonfinite: str,
) -> None:
    """Fold one backend's records (the host's: ``numbers`` and the host records of
    ``accs``; a device's: the records of ``accs``): one batch for all, each kind
    reducing its own rows into ``table``."""
    with np.errstate(all="ignore"):  # inf and NaN give what the arithmetic gives
        batch, layout, flags = _batch(plan, numbers, accs, device, nonfinite)
        element_at, call_at = layout.element_at, layout.call_at
        added: list[tuple[int, np.ndarray, np.ndarray]] = []  # host rows that add
        for i, group in enumerate(plan.groups):
            start, stop = plan.bounds[i], plan.bounds[i + 1]
            elements = slice(element_at[start], element_at[stop])
            if elements.start == elements.stop:
                continue  # nothing of this kind was logged since the last fold
            kind = group.kind
            part = batch.part(slice(start, stop), elements, slice(call_at[start], call_at[stop]))
            sums, maxes = kind.reduce(part)
            positions = group.positions(table)
            if kind.replaces:  # a row with no selected value keeps the old one
                present = part.count() > 0
                if batch.on_host:
                    table.replace(positions, sums, maxes, present)
                else:
                    table.replace_device(positions, sums, maxes, present)
            elif batch.on_host:
                added.append((i, sums, maxes))
            else:
                table.add_device(positions, sums, maxes)
            if kind.has_extra:
                _fold_extras(table, kind, positions[0], kind.reduce_extra(part), batch.on_host)
        if added:
            sum_positions, max_positions = plan.positions([i for i, _, _ in added], table)
            table.add(
                sum_positions,
                np.concatenate([sums.reshape(-1) for _, sums, _ in added]),
                max_positions,
                np.concatenate([maxes.reshape(-1) for _, _, maxes in added]),
            )
        if flags is not None:
            table.add_counts(plan.rows, flags)


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


class _Layout(NamedTuple):
    """Where a fold's elements go: the joined records put in plan order, and the
    boundaries of each plan row's elements and calls."""

    order: np.ndarray | None  # elements into plan order (None: they are in it)
    call_order: np.ndarray | None
    segments: np.ndarray  # per element (in plan order), its plan row
    lengths: np.ndarray  # per plan row, its elements
    element_at: list[int]  # per plan row, where its elements start (and the end)
    call_at: list[int]  # per plan row, where its calls start (and the end)
    ones: np.ndarray  # a 1 per call (the call lengths of flat numbers)

    @staticmethod
    def make(rows: np.ndarray, call_rows: np.ndarray, num_rows: int) -> _Layout:
        """The layout of elements and calls whose plan rows are ``rows``, ``call_rows``
        (each in the order recorded)."""
        order = call_order = None
        if len(rows) > 1 and (rows[1:] < rows[:-1]).any():
            order = np.argsort(rows, kind="stable")
            rows = rows[order]
        if len(call_rows) > 1 and (call_rows[1:] < call_rows[:-1]).any():
            call_order = np.argsort(call_rows, kind="stable")
        lengths = np.bincount(rows, minlength=num_rows)
        row_calls = np.bincount(call_rows, minlength=num_rows)
        element_at = np.concatenate(([0], np.cumsum(lengths))).tolist()
        call_at = np.concatenate(([0], np.cumsum(row_calls))).tolist()
        ones = np.ones(len(call_rows), dtype=np.int64)
        return _Layout(order, call_order, rows, lengths, element_at, call_at, ones)


def _batch(
    plan: _Plan,
    numbers: NumberRecords | None,
    accs: list[Accumulator],
    device: torch.device | None,
    nonfinite: str,
) -> tuple[Batch, _Layout, Array | None]:
    """The records as one screened batch in ``plan``'s order (each metric's elements
    together, in call order), its layout, and per metric its framework counts
    ([non-finite, rejected], None when no call needed a data check)."""
    if not accs:  # python numbers only: checked when logged, one element per call
        layout = plan.numbers_layout(numbers)
        value, weight = numbers.arrays()
        if layout.order is not None:
            value, weight = value[layout.order], weight[layout.order]
        batch = Batch(value, weight, layout.segments, layout.lengths, layout.ones)
        batch.all_selected = True  # a python number with weight 0 is not recorded
        return batch, layout, None
    # per source (the flat numbers first, then each metric's own records): values,
    # weights, each element's and each call's plan row, call sizes
    values, weights, element_rows, call_rows, call_lengths = [], [], [], [], []
    if numbers is not None and numbers.values:
        number_values, number_weights = numbers.arrays()
        rows = plan.index[np.fromiter(numbers.rows, np.int64, len(numbers.rows))]
        values.append(number_values)
        weights.append(number_weights)
        element_rows.append(rows)
        call_rows.append(rows)
        call_lengths.append(np.ones(len(rows), dtype=np.int64))
    parts = _Parts()
    for acc in accs:
        parts.add(acc)
    parts.flush()
    acc_rows = plan.index[np.fromiter(map(_get_row, accs), np.int64, len(accs))]
    values.append(assemble(parts.values, device))
    weights.append(assemble(parts.weights, device))
    element_rows.append(np.repeat(acc_rows, parts.lengths))
    call_rows.append(np.repeat(acc_rows, [len(acc.values) for acc in accs]))
    call_lengths.append(np.asarray(parts.call_lengths, dtype=np.int64))
    value, weight = _joined(values, device), _joined(weights, device)
    call_row, call_length = _joined_host(call_rows), _joined_host(call_lengths)
    num_rows = len(plan.rows)
    layout = _Layout.make(_joined_host(element_rows), call_row, num_rows)
    if layout.order is not None:
        order = _on(layout.order, device)
        value, weight = value[order], weight[order]
    if layout.call_order is not None:
        call_row, call_length = call_row[layout.call_order], call_length[layout.call_order]
    make = Batch if device is None else DeviceBatch
    batch = make(value, weight, _on(layout.segments, device), layout.lengths, call_length)
    flags = None
    zero = 0.0
    if nonfinite != "propagate" or any(map(_get_num_checked, accs)):
        calls = _on(np.repeat(np.arange(len(call_length)), call_length), device)
        bad = ~((weight >= 0) & (weight < math.inf))  # NaN fails both
        if nonfinite == "error":
            bad = bad | ((weight > 0) & ~batch.isfinite(value))
        call_bad = batch.sum_by(bad * 1.0, calls, len(call_length)) > 0
        rejected = batch.sum_by(call_bad * 1.0, _on(call_row, device), num_rows)
        weight = batch.where(call_bad[calls], zero, weight)
        skipped = rejected * 0.0
        if nonfinite == "skip":
            finite = batch.isfinite(value)
            skipped = batch.sum_by(((weight > 0) & ~finite) * 1.0)
            weight = batch.where(finite, weight, zero)
        flags = batch.columns(skipped, rejected)
    selected = weight > 0
    batch.weights, batch.values = weight, batch.where(selected, value, zero)
    batch._selected = selected
    return batch, layout, flags


def _joined(arrays: list[Array], device: torch.device | None) -> Array:
    """Host arrays and (on a device) tensors as one 1-D array on the fold's backend."""
    if device is not None:
        arrays = [a if isinstance(a, Tensor) else to_device(a, device) for a in arrays]
        return torch.cat(arrays) if len(arrays) > 1 else arrays[0]
    return np.concatenate(arrays) if len(arrays) > 1 else arrays[0]


def _joined_host(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays) if len(arrays) > 1 else arrays[0]


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
