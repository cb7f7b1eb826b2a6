"""``StepPlan``: the one owner of everything a tracker keeps between steps.

A steady-state step logs the same metrics as an earlier one, so what the fold and the
packing derive from the set of metrics (the fold plan per device, with its table
positions and the layout of the flat numbers; the packing of ``compute(sync=False)``
and ``state()``; per process group, the packing of the sync; the device copies of
index arrays) is made once and reused, and so are the buffers the host fold writes
its large temporaries into (``HostScratch``). Each keeps the entries of the last few sets
(``RECENT_ENTRIES``): a training loop may log a few sets in turn (a step that generates
and logs rewards, then steps that reuse its samples and do not). Each tracker holds one
``StepPlan`` (a tracker's ``_plan``); pickling or copying a tracker gives the copy a new,
empty one.

The one invalidation rule: an entry is reused while the step's metric records are the
same objects, in the same order, as those it was made for (``same_metrics``), and the
table's rows keep their numbering (``StateTable.version``); a new version drops every entry
made from rows. Identity is enough because a tracker keeps each name's MetricRecords
across steps while its kind stays and never files one object under two names
(``Tracker._add_metric``), so the same objects mean the same names, kinds and rows.

A ``FoldPlan`` orders the metrics of one fold (the host's or one device's) kind by kind;
each kind's metrics reduce as one slice of the batch. An ``ElementOrder`` puts the
records' elements and calls into that order (a stable sort by metric) and says where
each metric's begin. Both are kept across steps while the same metrics come back
(``StepPlan.fold_plan``; a fold plan keeps the layout of its flat numbers while their row
list is the same).

What is the same on every rank of a process group (the layouts agreed over it) is not
per tracker: it lives in ``rlmetrics._engine.sync``, per group.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from itertools import accumulate
from operator import attrgetter, is_
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import numpy as np
import torch
from torch import Tensor

from rlmetrics._engine.host_batch import BatchRows
from rlmetrics._engine.layout import BufferLayout
from rlmetrics._engine.packing import Packing, in_order
from rlmetrics._engine.record import MetricRecords, NumberRecords
from rlmetrics._engine.table import StateTable
from rlmetrics.kinds.batch import to_device

RECENT_ENTRIES = 4
"""Entries each cache keeps, one per set of metrics, newest first."""

MAX_DEVICE_INDICES = 256
"""Device index copies kept before the cache is emptied (arrays of metric sets that
came and went)."""


class GroupPacking(Protocol):
    """A tracker's state for one process group (``rlmetrics._engine.sync.GroupSync``),
    as far as the plan needs it."""

    def forget_packing(self) -> None:
        """Drop what was made from the table's rows; keep what names metrics only."""


def same_metrics(made_for: list[MetricRecords], metrics: list[MetricRecords]) -> bool:
    """Whether an entry made for the metric records ``made_for`` serves ``metrics``: the
    same objects in the same order (see the module's invalidation rule)."""
    return len(made_for) == len(metrics) and all(map(is_, made_for, metrics))


Entry = TypeVar("Entry")


class RecentEntries(Generic[Entry]):
    """The entries made for the last ``RECENT_ENTRIES`` sets of metric records, newest
    first, each with the metric records it was made for."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: list[tuple[list[MetricRecords], Entry]] = []

    def get(self, metrics: list[MetricRecords]) -> Entry | None:
        """The entry made for ``metrics`` (``same_metrics``), or None."""
        for made_for, entry in self.entries:
            if same_metrics(made_for, metrics):
                return entry
        return None

    def put(self, metrics: list[MetricRecords], entry: Entry) -> None:
        """Keep ``entry`` for ``metrics`` first (in place of an older one for them); the
        oldest beyond ``RECENT_ENTRIES`` drops."""
        others = [kept for kept in self.entries if not same_metrics(kept[0], metrics)]
        self.entries = [(metrics, entry), *others][:RECENT_ENTRIES]

    def clear(self) -> None:
        self.entries = []


class StepPlan:
    """Every cache of one tracker (see the module docstring for the rule).

    Attributes:
        scratch: the host fold's reusable buffers (``HostScratch``), which no
            invalidation drops: they hold no metric's data past a fold.
        group_syncs: per process group (keyed by the group object, weakly; never by
            id(), which a new group may reuse on some ranks only), the tracker's sync
            state: the packings of its recent sets of metrics for that group.
    """

    def __init__(self) -> None:
        self._version: int | None = None  # the table row numbering the entries were made for
        self._folds: dict[torch.device | None, RecentEntries[FoldPlan]] = {}
        self._local: RecentEntries[Packing] = RecentEntries()
        self._indices: dict[tuple[int, torch.device], tuple[np.ndarray, Tensor]] = {}
        self.group_syncs: weakref.WeakKeyDictionary[Any, GroupPacking] = weakref.WeakKeyDictionary()
        self.scratch = HostScratch()  # the host fold's large temporaries

    def __reduce__(self) -> tuple[type[StepPlan], tuple[()]]:
        return StepPlan, ()  # a copy starts empty: its entries name the original's objects

    def valid_for(self, table: StateTable) -> None:
        """Drop every entry made from rows when ``table``'s rows were renumbered since."""
        if table.version != self._version:
            self._version = table.version
            self._folds.clear()
            self._local.clear()
            self._indices.clear()
            for sync in self.group_syncs.values():
                sync.forget_packing()

    def fold_plan(
        self, table: StateTable, device: torch.device | None, metrics: list[MetricRecords]
    ) -> FoldPlan:
        """The plan of ``metrics`` folding on ``device`` (None: the host); the recent ones
        per device are kept."""
        self.valid_for(table)
        recent = self._folds.get(device)
        if recent is None:
            recent = self._folds[device] = RecentEntries()
        plan = recent.get(metrics)
        if plan is None:
            plan = FoldPlan(metrics, table)
            recent.put(metrics, plan)
        return plan

    def local_packing(
        self, metric_records: Mapping[str, MetricRecords], table: StateTable
    ) -> Packing:
        """The packing of this process's step alone (``compute(sync=False)``,
        ``state()``), its layout the metrics' order."""
        self.valid_for(table)
        metrics = list(metric_records.values())
        packing = self._local.get(metrics)
        if packing is None:
            layout = BufferLayout(
                [(name, records.kind) for name, records in metric_records.items()]
            )
            packing = Packing.make(layout, in_order(metric_records, layout), table)
            self._local.put(metrics, packing)
        return packing

    def index_on(self, positions: np.ndarray, device: torch.device) -> Tensor:
        """``positions`` (an index array a fold plan keeps across steps) on ``device``,
        copied there once per array rather than once per step."""
        key = (id(positions), device)
        cached = self._indices.get(key)
        if cached is None or cached[0] is not positions:
            if len(self._indices) > MAX_DEVICE_INDICES:
                self._indices.clear()
            cached = self._indices[key] = (positions, to_device(positions, device))
        return cached[1]


_get_row = attrgetter("row")


class ElementOrder(NamedTuple):
    """Where a fold's elements go: the joined records put in plan order, and the
    boundaries of each plan row's elements and calls."""

    order: np.ndarray | None  # elements into plan order (None: they are in it)
    segments: np.ndarray | None  # per element (in plan order), its plan row (None: not made)
    lengths: np.ndarray  # per plan row, its elements
    starts: np.ndarray  # per plan row, where its elements start
    full: bool  # every plan row has an element
    element_at: list[int]  # per plan row, where its elements start (and the end)
    call_at: list[int]  # per plan row, where its calls start (and the end)
    call_rows: np.ndarray  # per call (in plan order), its plan row
    call_lengths: np.ndarray  # per call (in plan order), its elements

    @staticmethod
    def make(
        rows: np.ndarray, call_rows: np.ndarray, call_lengths: np.ndarray, num_rows: int
    ) -> ElementOrder:
        """The layout of elements whose plan rows are ``rows`` and calls whose plan rows
        and sizes are ``call_rows``, ``call_lengths`` (each in the order recorded)."""
        order = None
        if len(rows) > 1 and (rows[1:] < rows[:-1]).any():
            order = np.argsort(rows, kind="stable")
            rows = rows[order]
        if len(call_rows) > 1 and (call_rows[1:] < call_rows[:-1]).any():
            call_order = np.argsort(call_rows, kind="stable")
            call_rows, call_lengths = call_rows[call_order], call_lengths[call_order]
        lengths = np.bincount(rows, minlength=num_rows)
        row_calls = np.bincount(call_rows, minlength=num_rows)
        return ElementOrder._of(order, rows, lengths, row_calls, call_rows, call_lengths)

    @staticmethod
    def of_sorted(
        rows: np.ndarray,
        lengths: np.ndarray,
        calls: np.ndarray,
        call_lengths: list[int],
        num_rows: int,
    ) -> ElementOrder:
        """The layout of records already in plan order: the metrics at plan rows ``rows``
        (ascending, each once) hold ``lengths`` elements in ``calls`` calls each, and the
        calls, in order, hold ``call_lengths`` elements. Its element segments are not
        made: the batch's rows make them from the lengths if a sum needs them."""
        row_lengths = np.zeros(num_rows, dtype=np.int64)
        row_lengths[rows] = lengths
        row_calls = np.zeros(num_rows, dtype=np.int64)
        row_calls[rows] = calls
        call_rows = rows.repeat(calls)  # array methods: no numpy wrapper per call
        call_sizes = np.asarray(call_lengths, dtype=np.int64)
        return ElementOrder._of(None, None, row_lengths, row_calls, call_rows, call_sizes)

    @staticmethod
    def _of(
        order: np.ndarray | None,
        segments: np.ndarray | None,
        lengths: np.ndarray,
        row_calls: np.ndarray,
        call_rows: np.ndarray,
        call_lengths: np.ndarray,
    ) -> ElementOrder:
        ends = lengths.cumsum()  # array methods: no numpy wrapper per call
        element_at = [0, *ends.tolist()]
        call_at = [0, *row_calls.cumsum().tolist()]
        starts, full = ends - lengths, bool(lengths.all())
        return ElementOrder(
            order, segments, lengths, starts, full, element_at, call_at, call_rows, call_lengths
        )


class NumbersOrder(NamedTuple):
    """The layout of a step's flat python numbers, kept while their row list is the
    same: the elements' plan order, the batch's rows, and the weights when none was
    logged: all 1, as a bool mask of True (read-only), which the batch reads as a
    selection, so that its weight sums are its counts and its weighted values its
    values, neither computed."""

    rows: list[int]  # per number, its table row, as recorded
    layout: ElementOrder
    batch_rows: BatchRows
    unit_weights: np.ndarray


class Group:
    """Metrics of one kind, and (computed once) their rows' positions in the table."""

    def __init__(self, members: list[MetricRecords]) -> None:
        self.members = members
        self.kind = members[0].kind
        self._positions: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def positions(self, table: StateTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The members' rows, and their (rows, slots) SUM and MAX positions."""
        if self._positions is None:
            rows = np.fromiter(map(_get_row, self.members), np.int64, len(self.members))
            self._positions = (rows, *table.positions(rows, self.kind))
        return self._positions


class FoldPlan:
    """The metrics of one fold grouped by kind (``members`` in that order), and where
    each table row's metric is in that order (``index``: -1 for a row not in it)."""

    def __init__(self, metrics: list[MetricRecords], table: StateTable) -> None:
        by_kind: dict[int, list[MetricRecords]] = {}
        for records in metrics:
            by_kind.setdefault(id(records.kind), []).append(records)
        self.groups = [Group(members) for members in by_kind.values()]
        self.members = [records for group in self.groups for records in group.members]
        self.bounds = list(accumulate((len(group.members) for group in self.groups), initial=0))
        self.rows = np.fromiter(map(_get_row, self.members), np.int64, len(self.members))
        self.index = np.full(table.num_rows, -1, dtype=np.int64)
        self.index[self.rows] = np.arange(len(self.rows))
        self._numbers: NumbersOrder | None = None
        self._positions: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}

    def positions(
        self, groups: tuple[int, ...], table: StateTable
    ) -> tuple[np.ndarray, np.ndarray]:
        """The SUM and MAX positions of the rows of ``groups`` (indices into
        ``self.groups``), flat, in order; kept per set of groups."""
        cached = self._positions.get(groups)
        if cached is None:
            sums, maxes = [], []
            for i in groups:
                _, sum_positions, max_positions = self.groups[i].positions(table)
                sums.append(sum_positions.reshape(-1))
                maxes.append(max_positions.reshape(-1))
            cached = self._positions[groups] = (np.concatenate(sums), np.concatenate(maxes))
        return cached

    def numbers_order(self, numbers: NumberRecords) -> NumbersOrder:
        """The layout of the flat ``numbers``; the last one is kept, since a
        steady-state step logs its metrics in the same order every time."""
        cached = self._numbers
        if cached is not None and cached.rows == numbers.rows:
            return cached
        rows = self.number_rows(numbers)
        calls = np.ones(len(rows), dtype=np.int64)  # one element per call
        layout = ElementOrder.make(rows, rows, calls, len(self.rows))
        batch_rows = BatchRows(layout.segments, layout.lengths, calls, layout.starts, layout.full)
        ones = np.ones(len(rows), dtype=np.bool_)
        ones.flags.writeable = False
        self._numbers = NumbersOrder(list(numbers.rows), layout, batch_rows, ones)
        return self._numbers

    def number_rows(self, numbers: NumberRecords) -> np.ndarray:
        """Per flat number, its metric's place in this plan."""
        return self.index[np.fromiter(numbers.rows, np.int64, len(numbers.rows))]


SCRATCH_GROWTH = 8
"""A buffer that must grow gets an eighth more than asked, so that a step size that
creeps up does not reallocate at every step."""

SCRATCH_SHRINK_AFTER = 8
"""Folds in a row that use under an eighth of a buffer before it is made smaller."""


class HostScratch:
    """One reusable host buffer per dtype, for the host fold's large temporaries.

    A host fold of float32 tensors with bool masks joins the values and the masks,
    zeroes the unselected values in place and sums them as float64 (a kind that reads
    the values themselves gets them widened into a third buffer): arrays as large as
    the step's data. Made anew each step, memory of that size may come fresh from the
    system each time, a page fault per page, which costs more than the pass that
    writes it. So a tracker keeps one buffer per dtype, as large as its recent folds
    need, and each fold writes into the start of it.

    Nothing in a buffer outlives its fold: the kinds' reductions and extras are new
    arrays (a ``Batch``'s arrays are valid while the fold runs), and a tracker folds one
    step at a time (its lock). A buffer that recent folds used little of is given back:
    one huge step does not hold its memory for the rest of the run.
    """

    def __init__(self) -> None:
        self._buffers: dict[Any, np.ndarray] = {}
        self._little_used: dict[Any, int] = {}  # per buffer, folds in a row that used little

    def take(self, size: int, dtype: Any) -> np.ndarray:
        """The first ``size`` elements of the ``dtype`` buffer, which the caller may write
        over until its fold ends."""
        buffer = self._buffers.get(dtype)
        if buffer is None or not self._kept(dtype, size, len(buffer)):
            buffer = self._buffers[dtype] = np.empty(size + size // SCRATCH_GROWTH, dtype)
        return buffer[:size]

    def _kept(self, key: Any, size: int, held: int) -> bool:
        """Whether the buffer ``key``, which holds ``held``, is kept for a use of ``size``
        (in the same unit): it is large enough, and recent folds did not all use under
        ``1 / SCRATCH_GROWTH`` of it."""
        if size * SCRATCH_GROWTH >= held:
            self._little_used[key] = 0
            return size <= held
        little = self._little_used[key] = self._little_used.get(key, 0) + 1
        if little < SCRATCH_SHRINK_AFTER:
            return True
        self._little_used[key] = 0
        return False
