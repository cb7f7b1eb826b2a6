"""Step end: every metric's records reduced into its state, one pass per kind and device.

A log call only records its value and weight (``rlmetrics._engine.record``). Here the
records of all metrics on one backend become one ``Batch``: host data with numpy, and a
metric with a tensor record on that tensor's device. ``rlmetrics._engine.assemble``
joins the records into flat arrays. The number of torch operations follows the kinds,
devices and shapes logged, not the number of calls. The framework's rules apply to the
whole batch at once (below). Then each kind's ``reduce`` makes one state row per
metric, and the rows land in the metrics' rows of the ``StateTable``.

Rules, the same on every backend:

* An element with weight 0 contributes nothing, whatever its value. Its value becomes 0
  before any arithmetic (``NaN * 0`` is NaN).
* A call with a negative or non-finite weight is rejected whole, as is one with a
  non-finite selected value under ``nonfinite="error"``. It contributes nothing, it is
  counted, and ``compute()`` reports it.
* ``nonfinite="skip"`` drops non-finite selected elements and counts them.

A tensor recorded by reference (a device tensor; CPU tensors are copied at the call) may
change in place before the fold. Its version counter then moved, or, after
``tensor.data = other``, which moves none, its size may no longer match. Either raises
``ModifiedInputError`` naming the metric: its value at the log call is gone.
"""

from __future__ import annotations

import math
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from rlmetrics._engine.assemble import (
    MASK_DTYPES,
    Parts,
    assemble,
    joined,
    made_anew,
    on_backend,
    part_dtypes,
    part_size,
)
from rlmetrics._engine.host_batch import BatchRows, HostBatch
from rlmetrics._engine.plan import ElementOrder, FoldPlan, HostScratch, StepPlan
from rlmetrics._engine.record import MetricRecords, NumberRecords
from rlmetrics._engine.table import StateTable
from rlmetrics.errors import ModifiedInputError
from rlmetrics.kinds.base import carries_extra
from rlmetrics.kinds.batch import Array, Batch, DeviceBatch
from rlmetrics.kinds.extra import ExtraKind


def joined_errors(errors: list[ValueError]) -> ValueError:
    """Several folds' errors of one step as one.

    It is a ``ModifiedInputError`` when they all are, else a ValueError. The messages
    come in order, and ``calls`` counts every dropped call by metric. An error without
    ``calls`` dropped calls of no known metric."""
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
    """A backend's joined values and weights differ in length: ``metrics`` hold a record
    whose value and weight sizes differ (a tensor given data of another size by
    ``tensor.data = other`` after its log call's checks)."""

    def __init__(self, metrics: list[MetricRecords]) -> None:
        super().__init__(f"misaligned records of {[records.name for records in metrics]}")
        self.metrics = metrics


def fold(
    metrics: list[MetricRecords],
    numbers: NumberRecords,
    table: StateTable,
    caches: StepPlan,
    nonfinite: str,
    *,
    flat_only: bool = False,
) -> None:
    """Reduce the records of ``metrics`` and the tracker's flat ``numbers`` into ``table``.

    Every record is cleared, also when a reduce raises: no metric holds records after a
    fold. ``caches`` keeps the fold plans and device indices across steps.
    ``flat_only``: every call since the last fold was a flat python number, so no
    metric holds records of its own and none need be looked through.

    Host data folds first, then each device's. A metric's flat numbers were all logged
    before its first tensor record, so a kind that keeps the latest value sees them in
    call order.

    Raises:
        ModifiedInputError: a logged tensor changed in place. The records of the metrics
            named are dropped (reported once); every other metric is folded.
    """
    table.value_rejections = nonfinite == "error"  # what ``_screen`` counts first
    Fold(table, caches, nonfinite, numbers).run(metrics, flat_only)


class Fold:
    """One fold's inputs, which its stages share: the tracker's state table, its caches,
    its non-finite policy and its flat python numbers."""

    __slots__ = ("caches", "nonfinite", "numbers", "table")

    def __init__(
        self, table: StateTable, caches: StepPlan, nonfinite: str, numbers: NumberRecords
    ) -> None:
        self.table = table
        self.caches = caches
        self.nonfinite = nonfinite
        self.numbers = numbers

    def run(self, metrics: list[MetricRecords], flat_only: bool) -> None:
        """``fold``'s work: every backend folded, every record cleared."""
        with_records = [] if flat_only else list(filter(_get_values, metrics))
        try:
            if with_records:
                # outside autograd: a logged tensor may have been made to require grad since
                with torch.no_grad():
                    modified = self._by_backend(metrics, with_records)
            else:
                modified = self._by_backend(metrics, with_records)
            dropped = (
                {records.name: len(records.values) for records in modified} if modified else {}
            )
        finally:
            self.numbers.clear()
            for records in with_records:  # each holds an array record (numbers go flat)
                records.clear_records()
        if dropped:
            names = ", ".join(map(repr, dropped))
            raise ModifiedInputError(
                "tensors logged this step were changed in place before compute(), so the "
                "values they had when logged are gone; log a copy (tensor.clone()) or log "
                f"after the change. Metrics dropped from this step: {names}",
                dropped,
            )

    def _by_backend(
        self, metrics: list[MetricRecords], with_records: list[MetricRecords]
    ) -> list[MetricRecords]:
        """Fold the host's records, then each device's. Returns the metrics whose tensors
        changed in place: their records are left out."""
        modified: list[MetricRecords] = []
        if any(map(_get_versions, with_records)):
            modified = [m for m in with_records if m.versions and _modified(m)]
            with_records = [m for m in with_records if m not in modified]  # identity
        on_device: dict[Any, list[MetricRecords]] = {}
        host: list[MetricRecords] = []
        for records in with_records:
            if records.record_device is None:
                host.append(records)
            else:
                on_device.setdefault(records.record_device, []).append(records)
        table, caches = self.table, self.caches
        if self.numbers.values or host:
            plan = caches.fold_plan(table, None, metrics)
            if self.numbers.values:  # first, as an early fold would: their own cached layout
                self._fold_numbers(plan)
            if host:
                modified += self._fold_aligned(plan, host, None)
        for device, members in on_device.items():
            plan = caches.fold_plan(table, device, members)
            modified += self._fold_aligned(plan, plan.members, device)
        return modified

    def _fold_aligned(
        self, plan: FoldPlan, metrics: list[MetricRecords], device: torch.device | None
    ) -> list[MetricRecords]:
        """Fold one backend's records. Returns the metrics left out because a record's
        value and weight sizes no longer agree (``_Misaligned``). They are found before
        anything is folded, so the others fold as if they came alone."""
        try:
            self._fold_records(plan, metrics, device)
            return []
        except _Misaligned as error:
            misaligned = error.metrics
        kept = [m for m in metrics if m not in misaligned]  # identity
        if kept:
            if device is not None:  # a device's plan is made for its metrics alone
                plan = self.caches.fold_plan(self.table, device, kept)
                kept = plan.members
            self._fold_records(plan, kept, device)
        return misaligned

    @np.errstate(all="ignore")  # inf and NaN give what the arithmetic gives
    def _fold_numbers(self, plan: FoldPlan) -> None:
        """Fold the flat python numbers (the host's). The floating-point state is set
        by decorating, which enters no context manager of Python's per call."""
        batch, layout = self._numbers_batch(plan)
        self._reduce(plan, batch, layout, None, None)

    @np.errstate(all="ignore")  # inf and NaN give what the arithmetic gives
    def _fold_records(
        self, plan: FoldPlan, metrics: list[MetricRecords], device: torch.device | None
    ) -> None:
        """Fold the records of ``metrics``, one backend's, as one screened batch (the
        floating-point state set as for ``_fold_numbers``)."""
        batch, layout = _joined_batch(plan, metrics, device, self.caches.scratch)
        counts = None
        if self.nonfinite != "propagate" or any(map(_get_num_deferred_checks, metrics)):
            counts = _screen(batch, layout, device, self.nonfinite)
        batch.zero_unselected()
        self._reduce(plan, batch, layout, counts, device)

    def _numbers_batch(self, plan: FoldPlan) -> tuple[Batch, ElementOrder]:
        """The flat python numbers as one batch in ``plan``'s order, and its layout.

        They were checked when logged: none is rejected, and each is one element."""
        numbers = self.numbers
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
        # all selected: a python number with weight 0 is not recorded
        return HostBatch(value, weight, cached.batch_rows, all_selected=True), layout

    def _reduce(
        self,
        plan: FoldPlan,
        batch: Batch,
        layout: ElementOrder,
        counts: Array | None,
        device: torch.device | None,
    ) -> None:
        """Each kind reduces its own rows of ``batch``. All that adds lands in the table
        with one indexed add and one indexed max; ``counts`` (per metric, [non-finite,
        rejected]; None when no call needed a data check) is added too."""
        table, index_on = self.table, self.caches.index_on
        element_at, call_at = layout.element_at, layout.call_at
        added: list[tuple[int, Array, Array]] = []  # (group, flat sums, flat maxes)
        for i in range(len(plan.groups)):
            start, stop = plan.bounds[i], plan.bounds[i + 1]
            elements = slice(element_at[start], element_at[stop])
            if elements.start == elements.stop:
                continue  # nothing of this kind was logged since the last fold
            kind = plan.groups[i].kind
            if len(plan.groups) == 1:  # the batch is the one kind's
                part = batch
            else:
                calls = slice(call_at[start], call_at[stop])
                part = batch.part(slice(start, stop), elements, calls)
            sums, maxes = kind.reduce(part)
            if kind.keeps_latest:  # a row with no selected value keeps the old one
                positions = plan.groups[i].positions(table)
                if batch.on_host:
                    every = part.all_selected and part.rows_full()
                    present = None if every else part.count() > 0
                    table.replace(positions, sums, maxes, present, index_on)
                else:
                    table.replace_device(positions, sums, maxes, part.count() > 0, index_on)
            else:
                added.append((i, sums.reshape(-1), maxes.reshape(-1)))
            if carries_extra(kind):
                rows = plan.groups[i].positions(table)[0]
                self._fold_extras(kind, rows, kind.reduce_extra(part), part)
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
                table.add_device(sum_positions, sums, max_positions, maxes, index_on)
        if counts is not None:
            table.add_counts(plan.rows, counts)

    def _fold_extras(
        self, kind: ExtraKind, rows: np.ndarray, extras: list[Any], batch: Batch
    ) -> None:
        """Merge a kind's batch extras into its metrics' extras, on the batch's side."""
        if batch.on_host:
            host_extras = self.table.extras
            for row, extra in zip(rows.tolist(), extras, strict=True):
                host_extras[row] = kind.merge_extra(host_extras[row], extra)
            return
        dev_extras = self.table.device_for(batch.values.device).extras
        for row, extra in zip(rows.tolist(), extras, strict=True):
            dev_extras[row] = kind.merge_dev_extra(dev_extras.get(row), extra)


_get_values = attrgetter("values")
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
    """Whether a record of ``records`` has an array or tensor weight of another size than
    its value."""
    return any(
        weight is not None and type(weight) is not float and part_size(value) != part_size(weight)
        for value, weight in zip(records.values, records.weights, strict=True)
    )


def _joined_batch(
    plan: FoldPlan, metrics: list[MetricRecords], device: torch.device | None, scratch: HostScratch
) -> tuple[Batch, ElementOrder]:
    """The records of ``metrics`` as one batch in ``plan``'s order, unscreened, and its layout.

    ``metrics`` are one backend's metrics with records of their own. Each metric's
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
    writable = parts.arenas == len(parts.values)  # each part a metric's arena
    value = assemble(parts.values, device, scratch=host_scratch, writable=writable)
    if device is None and part_dtypes(parts.weights) <= MASK_DTYPES:
        weight = assemble(parts.weights, device, np.bool_, scratch=host_scratch, writable=writable)
    else:  # float weights, or a device: never into the scratch
        weight = assemble(parts.weights, device)
    if len(value) != len(weight):
        raise _Misaligned([m for m in metrics if _misaligned(m)])
    calls = np.fromiter(map(len, map(_get_values, metrics)), np.int64, len(metrics))
    layout = ElementOrder.of_sorted(
        index, np.asarray(parts.lengths, dtype=np.int64), calls, parts.call_lengths, len(plan.rows)
    )
    if device is not None:
        return DeviceBatch(value, weight, None, layout.lengths, layout.call_lengths), layout
    rows = BatchRows(None, layout.lengths, layout.call_lengths, layout.starts, layout.full)
    if value.dtype == np.float32:  # joined into the scratch, left narrow
        widened = scratch.take(len(value), np.float64)
        return HostBatch(value, weight, rows, widened=widened), layout
    # values made for the batch, not a record itself, may be zeroed in place
    return HostBatch(value, weight, rows, owned=made_anew(value, parts.values)), layout


def _screen(
    batch: Batch, layout: ElementOrder, device: torch.device | None, nonfinite: str
) -> Array:
    """Apply the rules that need the data to ``batch``'s weights (a rejected call's and,
    under "skip", a non-finite element's become 0); per metric, [skipped, rejected].

    Under "error" nothing is skipped: the first count is then the calls rejected for a
    non-finite value alone (their weights were valid), so the error can say which rule
    each rejected call broke (``StateTable.value_rejections``)."""
    call_length = layout.call_lengths
    value, weight = batch.values, batch.weights
    calls = on_backend(np.repeat(np.arange(len(call_length)), call_length), device)
    call_rows = on_backend(layout.call_rows, device)
    bad_weight = ~((weight >= 0) & (weight < math.inf))  # NaN fails both
    bad = bad_weight
    if nonfinite == "error":
        bad = bad_weight | ((weight > 0) & ~batch.isfinite(value))
    call_bad = batch.sum_by(bad * 1.0, calls, len(call_length)) > 0
    rejected = batch.sum_by(call_bad * 1.0, call_rows, batch.num_rows)
    if nonfinite == "error":
        weight_ok = batch.sum_by(bad_weight * 1.0, calls, len(call_length)) == 0
        skipped = batch.sum_by((call_bad & weight_ok) * 1.0, call_rows, batch.num_rows)
    else:
        skipped = rejected * 0.0
    weight = batch.where(call_bad[calls], 0.0, weight)
    if nonfinite == "skip":
        finite = batch.isfinite(value)
        skipped = batch.sum_by(((weight > 0) & ~finite) * 1.0)
        weight = batch.where(finite, weight, 0.0)
    batch.weights = weight
    return batch.columns(skipped, rejected)
