"""Step end: every metric's records reduced into its state, one pass per kind and device.

A log call only records its value and weight (``rlmetrics._engine.record``). Here the records
of all metrics of a kind on one backend (host data with numpy; a metric with a tensor
record on that tensor's device) become one ``Batch``, with a number of torch operations
that depends on the kinds, devices and shapes logged but not on how many calls there
were; the framework's rules apply to the whole batch at once (below), then the kind's
``reduce`` makes one state row per metric, which folds into the metric's row of the state table.

The batch is assembled first: ``Parts`` lays a set of metrics' records (python numbers,
host arrays of any shape and real dtype, tensors) out as flat parts, each run of python
numbers one array, and ``assemble`` joins parts into one float64 array (numpy) or tensor
(on a device) with a number of torch operations that depends on the shape classes
present, not on how many parts there were (on the host, a few or large parts of several
classes are instead copied into place one by one, with numpy).

Rules, the same on every backend:

* An element with weight 0 contributes nothing, whatever its value: its value becomes 0
  before any arithmetic (``NaN * 0`` is NaN).
* A call with a negative or non-finite weight, or (``nonfinite="error"``) a non-finite
  selected value, is rejected whole: it contributes nothing and is counted, and
  ``compute()`` reports it.
* ``nonfinite="skip"`` drops non-finite selected elements and counts them.

A tensor recorded by reference (a device tensor; CPU tensors are copied at the call)
changed in place between its log call and the fold (its version counter moved, or,
given data of another size by ``tensor.data = other``, which moves no version, its size
no longer that of its value or weight) raises ``ModifiedInputError`` naming the metric:
its value at the log call is gone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from operator import attrgetter
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlmetrics._engine.inputs import REAL_DTYPES
from rlmetrics._engine.plan import ElementOrder, FoldPlan, HostScratch, StepPlan
from rlmetrics._engine.record import BOOL, MetricRecords, NumberRecords
from rlmetrics._engine.table import StateTable
from rlmetrics.errors import ModifiedInputError
from rlmetrics.kinds.base import carries_extra
from rlmetrics.kinds.batch import Array, Batch, BatchRows, DeviceBatch, to_device
from rlmetrics.kinds.extra import ExtraKind

SCRATCH_JOINS = {torch.float32: (np.float64, np.float32), BOOL: (np.bool_, np.bool_)}
"""The tensor dtypes a host fold joins into its scratch: per dtype, the dtype asked of
the join and the buffer's (float32 values, widened later; bool masks)."""

MASK_DTYPES = frozenset({BOOL, np.dtype(np.bool_)})
"""The dtypes of a weight part (a tensor or a host array) that is a bool mask."""

IN_PLACE_PARTS = 32
IN_PLACE_PART_SIZE = 256
"""A host fold's parts of several classes are copied into place one by one when they
are few (at most ``IN_PLACE_PARTS``), or large (``IN_PLACE_PART_SIZE`` elements each on
average) and interleaved: a copy per part costs more Python than a share of a class's
join, but saves the joins, their conversions and the permutation that restores the
order of interleaved classes, a pass of its own over every element."""

NUMPY_DTYPES = REAL_DTYPES - {torch.bfloat16}
"""The tensor dtypes a log call takes that numpy holds too: CPU tensors a host fold
reads as arrays."""


def joined_errors(errors: list[ValueError]) -> ValueError:
    """Several folds' errors of one step as one: a ``ModifiedInputError`` when they all
    are, else a ValueError; the messages in order, every dropped call counted in
    ``calls`` (an error without ``calls`` dropped calls of no known metric)."""
    message = " Then: ".join(map(str, errors))
    calls: dict[str, int] = {}
    for error in errors:
        for name, count in getattr(error, "calls", {}).items():
            calls[name] = calls.get(name, 0) + count
    if all(isinstance(error, ModifiedInputError) for error in errors):
        return ModifiedInputError(message, calls)
    joined = ValueError(message)
    joined.calls = calls  # type: ignore[attr-defined]
    return joined


class _Misaligned(RuntimeError):
    """A backend's joined values and weights differ in length: ``accs`` hold a record
    whose value and weight sizes differ (a tensor given data of another size by
    ``tensor.data = other`` after its log call's checks)."""

    def __init__(self, metrics: list[MetricRecords]) -> None:
        super().__init__(f"misaligned records of {[records.name for records in metrics]}")
        self.metrics = metrics


def fold(
    metrics: list[MetricRecords],
    numbers: NumberRecords,
    table: StateTable,
    steps: StepPlan,
    nonfinite: str,
    *,
    flat_only: bool = False,
) -> None:
    """Reduce the records of ``accs`` (their own, and the tracker's flat ``numbers``)
    into their rows of ``table``, with the fold plans and device indices ``steps``
    keeps; clear the records, also when a reduce raises (no metric of ``accs`` holds
    records after a fold).

    Host data folds first, then each device's: a metric's flat numbers were all logged
    before its first tensor record, so a kind that keeps the latest value sees them in
    call order. ``flat_only``: every call since the last fold was a flat python number
    (no metric holds records of its own), so the metrics need not be looked through.

    Raises:
        ModifiedInputError: a logged tensor changed in place; the records of the metrics
            named are dropped (reported once), every other metric is folded.
    """
    with_records = [] if flat_only else list(filter(_get_values, metrics))
    try:
        # outside autograd: a logged tensor may have been made to require grad since
        with torch.no_grad() if with_records else nullcontext():
            modified = _fold_all(metrics, with_records, numbers, table, steps, nonfinite)
        dropped = {records.name: len(records.values) for records in modified}
    finally:
        numbers.clear()
        for records in with_records:  # each holds an array record (numbers alone go flat)
            records.clear_records()
    if dropped:
        raise ModifiedInputError(
            "tensors logged this step were changed in place before compute(), so the "
            "values they had when logged are gone; log a copy (tensor.clone()) or log "
            f"after the change. Metrics dropped from this step: {', '.join(map(repr, dropped))}",
            dropped,
        )


def _fold_all(
    metrics: list[MetricRecords],
    with_records: list[MetricRecords],
    numbers: NumberRecords,
    table: StateTable,
    steps: StepPlan,
    nonfinite: str,
) -> list[MetricRecords]:
    """``fold``'s work, backend by backend; returns the metrics whose tensors changed
    in place (their records are left out)."""
    modified: list[MetricRecords] = []
    if any(map(_get_versions, with_records)):
        modified = [records for records in with_records if records.versions and _modified(records)]
        with_records = [records for records in with_records if records not in modified]  # identity
    on_device: dict[Any, list[MetricRecords]] = {}
    host: list[MetricRecords] = []
    for records in with_records:
        if records.record_device is None:
            host.append(records)
        else:
            on_device.setdefault(records.record_device, []).append(records)
    if numbers.values or host:
        plan = steps.fold_plan(table, None, metrics)
        if numbers.values:  # first, as an early fold would: their own cached layout
            _fold_records(table, steps, plan, numbers, [], None, nonfinite)
        if host:
            modified += _fold_aligned(table, steps, plan, host, None, nonfinite)
    for device, members in on_device.items():
        plan = steps.fold_plan(table, device, members)
        modified += _fold_aligned(table, steps, plan, plan.members, device, nonfinite)
    return modified


def _fold_aligned(
    table: StateTable,
    steps: StepPlan,
    plan: FoldPlan,
    metrics: list[MetricRecords],
    device: torch.device | None,
    nonfinite: str,
) -> list[MetricRecords]:
    """Fold one backend's records (``_fold_records``); returns the metrics left out
    because a record's value and weight sizes no longer agree (``_Misaligned``: found
    before anything is folded, so the others fold as if they came alone)."""
    try:
        _fold_records(table, steps, plan, None, metrics, device, nonfinite)
        return []
    except _Misaligned as error:
        misaligned = error.metrics
    kept = [records for records in metrics if records not in misaligned]  # identity
    if kept:
        if device is not None:  # a device's plan is made for its metrics alone
            plan = steps.fold_plan(table, device, kept)
            kept = plan.members
        _fold_records(table, steps, plan, None, kept, device, nonfinite)
    return misaligned


_get_values = attrgetter("values")
_get_dtype = attrgetter("dtype")
_get_versions = attrgetter("versions")
_get_row = attrgetter("row")
_get_num_deferred_checks = attrgetter("num_deferred_checks")


def _modified(records: MetricRecords) -> bool:
    """Whether a tensor recorded by reference changed in place since its log call (its
    version counter moved); ``versions`` holds each such tensor, then its version at the
    log call (a copy the log call made is not there: nothing else holds it)."""
    versions = records.versions
    return any(
        tensor._version != version
        for tensor, version in zip(versions[::2], versions[1::2], strict=True)
    )


def _misaligned(records: MetricRecords) -> bool:
    """Whether a record of ``acc`` has an array or tensor weight of another size than
    its value."""
    return any(
        weight is not None and type(weight) is not float and part_size(value) != part_size(weight)
        for value, weight in zip(records.values, records.weights, strict=True)
    )


def _fold_records(
    table: StateTable,
    steps: StepPlan,
    plan: FoldPlan,
    numbers: NumberRecords | None,
    metrics: list[MetricRecords],
    device: torch.device | None,
    nonfinite: str,
) -> None:
    """Fold one backend's records (the host's: ``numbers`` or the host records of
    ``accs``; a device's: the records of ``accs``): one batch for all, each kind reduces
    its own rows; all that adds lands in ``table`` with one indexed add and one indexed
    max."""
    with np.errstate(all="ignore"):  # inf and NaN give what the arithmetic gives
        batch, layout, counts = _batch(plan, numbers, metrics, device, nonfinite, steps.scratch)
        element_at, call_at = layout.element_at, layout.call_at
        added: list[tuple[int, Array, Array]] = []  # (group, flat sums, flat maxes)
        for i in range(len(plan.groups)):
            start, stop = plan.bounds[i], plan.bounds[i + 1]
            elements = slice(element_at[start], element_at[stop])
            if elements.start == elements.stop:
                continue  # nothing of this kind was logged since the last fold
            kind = plan.groups[i].kind
            part = batch.part(slice(start, stop), elements, slice(call_at[start], call_at[stop]))
            sums, maxes = kind.reduce(part)
            positions = plan.groups[i].positions(table)
            if kind.keeps_latest:  # a row with no selected value keeps the old one
                if batch.on_host:
                    every = part.all_selected and part.rows_full()
                    present = None if every else part.count() > 0
                    table.replace(positions, sums, maxes, present, steps.index_on)
                else:
                    table.replace_device(positions, sums, maxes, part.count() > 0, steps.index_on)
            else:
                added.append((i, sums.reshape(-1), maxes.reshape(-1)))
            if carries_extra(kind):
                _fold_extras(table, kind, positions[0], kind.reduce_extra(part), part)
        if added:
            if len(added) == 1:
                key, sums, maxes = added[0]
                keys: tuple[int, ...] = (key,)
            else:
                keys = tuple(key for key, _, _ in added)
                sums, maxes = (joined([a[j] for a in added], device) for j in (1, 2))
            sum_positions, max_positions = plan.positions(keys, table)
            if batch.on_host:
                table.add(sum_positions, sums, max_positions, maxes)
            else:
                table.add_device(sum_positions, sums, max_positions, maxes, steps.index_on)
        if counts is not None:
            table.add_counts(plan.rows, counts)


def _fold_extras(
    table: StateTable, kind: ExtraKind, rows: np.ndarray, extras: list[Any], batch: Batch
) -> None:
    if batch.on_host:
        for row, extra in zip(rows.tolist(), extras, strict=True):
            table.extras[row] = kind.merge_extra(table.extras[row], extra)
        return
    dev_extras = table.device_for(batch.values.device).extras
    for row, extra in zip(rows.tolist(), extras, strict=True):
        dev_extras[row] = kind.merge_dev_extra(dev_extras.get(row), extra)


def _batch(
    plan: FoldPlan,
    numbers: NumberRecords | None,
    metrics: list[MetricRecords],
    device: torch.device | None,
    nonfinite: str,
    scratch: HostScratch,
) -> tuple[Batch, ElementOrder, Array | None]:
    """The records as one screened batch in ``plan``'s order (each metric's elements
    together, in call order), its layout, and per metric its framework counts
    ([non-finite, rejected], None when no call needed a data check)."""
    if not metrics:  # python numbers only: checked when logged, one element per call
        assert numbers is not None  # a host fold without metric records has numbers
        cached = plan.numbers_order(numbers)
        layout = cached.layout
        if numbers.weight_at:
            value, weight = numbers.arrays()
            if layout.order is not None:
                weight = weight[layout.order]
        else:  # every weight is 1
            value, weight = numbers.value_array(), None
        if layout.order is not None:
            value = value[layout.order]
        weight = cached.unit_weights if weight is None else weight
        batch = Batch.of(value, weight, cached.batch_rows)
        batch.all_selected = True  # a python number with weight 0 is not recorded
        return batch, layout, None
    batch, layout, owned = _joined_batch(plan, metrics, device, scratch)
    counts = None
    if nonfinite != "propagate" or any(map(_get_num_deferred_checks, metrics)):
        counts = _screen(batch, layout, device, nonfinite)
    batch._zero_unselected(in_place=owned)
    return batch, layout, counts


def _joined_batch(
    plan: FoldPlan, metrics: list[MetricRecords], device: torch.device | None, scratch: HostScratch
) -> tuple[Batch, ElementOrder, bool]:
    """The records of ``accs`` (one backend's metrics with records of their own) as one
    batch in ``plan``'s order, unscreened, its layout, and whether its values are an
    array made for it (not a record itself, which may be written over). Each metric's
    records are laid out in turn, the metrics in plan order, so the elements need no
    sort."""
    index = plan.index[np.fromiter(map(_get_row, metrics), np.int64, len(metrics))]
    if len(index) > 1 and (index[1:] < index[:-1]).any():  # the host's come in tracker order
        order = np.argsort(index, kind="stable")
        metrics, index = [metrics[i] for i in order.tolist()], index[order]
    parts = Parts()
    for records in metrics:
        parts.add(records)
    parts.flush()
    host_scratch = scratch if device is None else None
    value = assemble(parts.values, device, scratch=host_scratch)
    if device is None and set(map(_get_dtype, parts.weights)) <= MASK_DTYPES:
        weight = assemble(parts.weights, device, np.bool_, scratch=host_scratch)
    else:  # float weights, or a device: never into the scratch
        weight = assemble(parts.weights, device)
    if len(value) != len(weight):
        raise _Misaligned([records for records in metrics if _misaligned(records)])
    calls = np.fromiter(map(len, map(_get_values, metrics)), np.int64, len(metrics))
    layout = ElementOrder.of_sorted(
        index, np.asarray(parts.lengths, dtype=np.int64), calls, parts.call_lengths, len(plan.rows)
    )
    place = None if device is None else _placer(device)
    rows = BatchRows(
        None, layout.lengths, layout.call_lengths, layout.starts, layout.full, None, place
    )
    if device is not None:
        return DeviceBatch.of(value, weight, rows), layout, False
    if value.dtype == np.float32:  # joined into the scratch, left narrow
        widened = scratch.take(len(value), np.float64)
        return Batch._of_narrow(value, weight, rows, widened), layout, False
    return Batch.of(value, weight, rows), layout, _made(value, parts.values)


def _made(value: np.ndarray, parts: list[Any]) -> bool:
    """Whether ``assemble`` made ``value`` (a join, a conversion or a tensor block's
    copy) rather than handing back a host part or a view of one."""
    return isinstance(value.base, (Tensor, type(None))) and all(value is not p for p in parts)


def _placer(device: torch.device) -> Callable[[np.ndarray], Tensor]:
    """What puts a host array on ``device``."""
    return lambda array: to_device(array, device)


def _screen(
    batch: Batch, layout: ElementOrder, device: torch.device | None, nonfinite: str
) -> Array:
    """Apply the rules that need the data to ``batch``'s weights (a rejected call's and,
    under "skip", a non-finite element's become 0); per metric, [skipped, rejected]."""
    call_length = layout.call_lengths
    value, weight = batch.values, batch.weights
    calls = on_backend(np.repeat(np.arange(len(call_length)), call_length), device)
    bad = ~((weight >= 0) & (weight < math.inf))  # NaN fails both
    if nonfinite == "error":
        bad = bad | ((weight > 0) & ~batch.isfinite(value))
    call_bad = batch.sum_by(bad * 1.0, calls, len(call_length)) > 0
    rejected = batch.sum_by(call_bad * 1.0, on_backend(layout.call_rows, device), batch.num_rows)
    weight = batch.where(call_bad[calls], 0.0, weight)
    skipped = rejected * 0.0
    if nonfinite == "skip":
        finite = batch.isfinite(value)
        skipped = batch.sum_by(((weight > 0) & ~finite) * 1.0)
        weight = batch.where(finite, weight, 0.0)
    batch.weights = weight
    return batch.columns(skipped, rejected)


def joined(arrays: list[Array], device: torch.device | None) -> Array:
    """Host arrays and (on a device) tensors as one 1-D array on the fold's backend
    (an empty float64 one for none)."""
    if not arrays:
        return on_backend(np.zeros(0), device)
    if device is not None:
        arrays = [a if isinstance(a, Tensor) else to_device(a, device) for a in arrays]
        return torch.cat(arrays) if len(arrays) > 1 else arrays[0]
    return np.concatenate(arrays) if len(arrays) > 1 else arrays[0]


ONLY_TENSORS = {Tensor}


def _types(items: Sequence[Any]) -> set[type]:
    """The types among ``items``."""
    return set(map(type, items))


class Parts:
    """Metrics' records as flat parts (host arrays or tensors), metric by metric in call
    order; each run of python numbers, across metrics, becomes one array."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self.weights: list[Any] = []
        self.call_lengths: list[int] = []
        self.lengths: list[int] = []
        self.numbers: list[float] = []
        self.number_weights: list[float] = []

    def add(self, records: MetricRecords) -> None:
        values, weights = records.values, records.weights
        if _types(values) == ONLY_TENSORS and _types(weights) == ONLY_TENSORS:
            # tensor values with tensor weights (a mask, most often): the parts as they are
            self.flush()
            sizes = list(map(Tensor.numel, values))
            self.values += values
            self.weights += weights
            self.call_lengths += sizes
            self.lengths.append(sum(sizes))
            return
        if not records.arrays:  # python numbers only: checked when logged, never rejected
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
            if weight is None or (type(weight) is float and weight == 1.0):  # all selected
                self.weights.append(np.ones(size, dtype=np.bool_))
            elif type(weight) is float:
                self.weights.append(np.full(size, weight))
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


def assemble(
    parts: Sequence[Any],
    device: torch.device | None,
    dtype: type = np.float64,
    *,
    scratch: HostScratch | None = None,
) -> Array:
    """Flat parts (host arrays of any shape and real dtype, tensors) as one 1-D float64
    array (``device`` None) or tensor on ``device``, in order; on the host ``dtype``
    may be ``np.bool_`` instead, for parts that are all bool masks. With ``scratch``
    (a host fold), parts that are all 1-D float32 tensors (values, left float32 for
    ``Batch._of_narrow`` to widen) or all 1-D bool tensors (masks) are joined into its
    buffer of their dtype.

    Tensors are joined by class (device, dtype, 0-d ones stacked, others by their
    trailing shape), so the number of torch operations depends on the classes, not on
    the number of parts; a permutation restores the order when the classes interleave.
    On the host, parts of several classes that are few, or large and interleaved
    (``IN_PLACE_PARTS``), are instead copied into place one by one (numpy, no torch
    operation).
    """
    host, classes = _classes(parts, device is not None)
    if scratch is not None and not host and len(classes) == 1:
        (((part_dtype, dims, *_), members),) = classes.items()
        asked, kept = SCRATCH_JOINS.get(part_dtype, (None, None))
        if dims == 1 and asked is dtype:
            tensors = [parts[i] for i in members]
            size = sum(map(Tensor.numel, tensors))
            out = scratch.take(size, kept)
            torch.cat(tensors, out=torch.from_numpy(out))
            return out
    several = bool(host) + len(classes) > 1  # blocks to join; one class needs no order
    order = host + [i for members in classes.values() for i in members] if several else []
    interleaved = several and order != sorted(order)  # the blocks need a permutation
    if several and device is None and all(key[0] in NUMPY_DTYPES for key in classes):
        sizes = list(map(part_size, parts))
        large = interleaved and sum(sizes) >= IN_PLACE_PART_SIZE * len(parts)
        if len(parts) <= IN_PLACE_PARTS or large:
            return _in_place(parts, sizes, dtype)
    blocks: list[Any] = []
    if host:
        flat = [_flat_host(parts[i], dtype) for i in host]
        blocks.append(np.concatenate(flat) if len(flat) > 1 else flat[0])
    target = device or torch.device("cpu")
    tensor_dtype = BOOL if dtype is np.bool_ else torch.float64
    for key, members in classes.items():
        tensors = [parts[i] for i in members]
        blocks.append(_tensor_block(tensors, key[1] == 0, target, tensor_dtype))
    if device is None:
        blocks = [b if isinstance(b, np.ndarray) else b.numpy() for b in blocks]
        flat_all = np.concatenate(blocks) if len(blocks) > 1 else blocks[0] if blocks else None
        if flat_all is None:
            return np.zeros(0, dtype=dtype)
    else:
        blocks = [to_device(b, device) if isinstance(b, np.ndarray) else b for b in blocks]
        if not blocks:
            return torch.zeros(0, dtype=torch.float64, device=device)
        flat_all = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
    if interleaved:
        sizes = [part_size(parts[i]) for i in order]
        permutation = _permutation(order, sizes)
        flat_all = flat_all[permutation if device is None else on_backend(permutation, device)]
    return flat_all


def _classes(
    parts: Sequence[Any], devices: bool
) -> tuple[list[int], dict[tuple[Any, ...], list[int]]]:
    """The host parts (indices), and the tensor parts by class: dtype, dimensions,
    trailing shape beyond one dimension, and (``devices``: a device fold, which may
    hold tensors of several devices) device. A host fold's tensors are all plain CPU
    ones."""
    host: list[int] = []
    classes: dict[tuple[Any, ...], list[int]] = {}
    if not devices and _types(parts) == ONLY_TENSORS:  # one class, most often: 1-D, one dtype
        dtypes = set(map(_get_dtype, parts))
        if len(dtypes) == 1 and set(map(Tensor.dim, parts)) == {1}:
            return host, {(dtypes.pop(), 1): list(range(len(parts)))}
    for i, part in enumerate(parts):
        if not isinstance(part, Tensor):
            host.append(i)
            continue
        dims = part.dim()
        key: tuple[Any, ...] = (
            (part.dtype, dims) if dims < 2 else (part.dtype, dims, part.shape[1:])
        )
        if devices:
            key += (part.device,)
        members = classes.get(key)
        if members is None:
            classes[key] = [i]
        else:
            members.append(i)
    return host, classes


def _in_place(parts: Sequence[Any], sizes: list[int], dtype: type) -> np.ndarray:
    """Host parts and CPU tensors of dtypes numpy holds, each copied (and converted) into
    its place in one new ``dtype`` array: already in order, one pass over the data."""
    out: np.ndarray = np.empty(sum(sizes), dtype)
    start = 0
    for part, size in zip(parts, sizes, strict=True):
        end = start + size
        out[start:end] = (part.numpy() if isinstance(part, Tensor) else part).reshape(-1)
        start = end
    return out


def _flat_host(part: np.ndarray, dtype: type = np.float64) -> np.ndarray:
    if part.ndim == 1 and part.dtype == dtype:
        return part
    return np.asarray(part, dtype=dtype).reshape(-1)


def _tensor_block(
    tensors: list[Tensor], scalar: bool, target: torch.device, dtype: torch.dtype
) -> Tensor:
    """Tensors of one class (device, dtype, 0-d or trailing shape) as one flat tensor of
    ``dtype`` on ``target``, a copy: joined in their own dtype, then converted (exact:
    one dtype per class); a lone tensor of another dtype is only converted (the
    conversion copies). ``reshape``, not ``view``: ``cat`` keeps its inputs' memory
    format (channels_last stays so), whose elements lie out of their logical order."""
    if len(tensors) == 1 and not scalar and tensors[0].dtype != dtype:
        return tensors[0].reshape(-1).to(target, dtype)
    joined = torch.stack(tensors) if scalar else torch.cat(tensors).reshape(-1)
    return joined.to(target, dtype)


def part_size(part: Any) -> int:
    """The elements of a record or part: a tensor, an array or a python number (one)."""
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


def on_backend(array: np.ndarray, device: torch.device | None) -> Array:
    """A host array on the fold's backend (itself for the host)."""
    return array if device is None else to_device(array, device)
