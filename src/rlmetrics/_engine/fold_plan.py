"""Which metrics a fold reduces, grouped by kind, and where their elements go.

A ``Plan`` orders the metrics of one fold (the host's or one device's) kind by kind;
each kind's metrics reduce as one slice of the batch. An ``ElementOrder``
puts the records' elements and calls into that order (a stable sort by metric) and
says where each metric's begin. Both are kept across steps while the same metrics come
back (``rlmetrics._engine.plan.StepPlan.fold_plan``; a plan keeps the layout of its
flat numbers while their row list is the same).
"""

from __future__ import annotations

from itertools import accumulate
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from rlmetrics._engine.record import NumberRecords
from rlmetrics._engine.table import StateTable
from rlmetrics.kinds.base import MetricRecords
from rlmetrics.kinds.rows import BatchRows

_get_row = attrgetter("row")


class ElementOrder(NamedTuple):
    """Where a fold's elements go: the joined records put in plan order, and the
    boundaries of each plan row's elements and calls."""

    order: np.ndarray | None  # elements into plan order (None: they are in it)
    segments: np.ndarray  # per element (in plan order), its plan row
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
        calls, in order, hold ``call_lengths`` elements."""
        row_lengths = np.zeros(num_rows, dtype=np.int64)
        row_lengths[rows] = lengths
        row_calls = np.zeros(num_rows, dtype=np.int64)
        row_calls[rows] = calls
        segments, call_rows = np.repeat(rows, lengths), np.repeat(rows, calls)
        call_sizes = np.asarray(call_lengths, dtype=np.int64)
        return ElementOrder._of(None, segments, row_lengths, row_calls, call_rows, call_sizes)

    @staticmethod
    def _of(
        order: np.ndarray | None,
        segments: np.ndarray,
        lengths: np.ndarray,
        row_calls: np.ndarray,
        call_rows: np.ndarray,
        call_lengths: np.ndarray,
    ) -> ElementOrder:
        ends = np.cumsum(lengths)
        element_at = [0, *ends.tolist()]
        call_at = [0, *np.cumsum(row_calls).tolist()]
        starts, full = ends - lengths, bool(lengths.all())
        return ElementOrder(
            order, segments, lengths, starts, full, element_at, call_at, call_rows, call_lengths
        )


class NumbersOrder(NamedTuple):
    """The layout of a step's flat python numbers, kept while their row list is the
    same: the elements' plan order, the batch's rows, and the weights when none was
    logged (all 1; read-only)."""

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


class Plan:
    """The metrics of one fold grouped by kind (``members`` in that order), and where
    each table row's metric is in that order (``index``: -1 for a row not in it)."""

    def __init__(self, accs: list[MetricRecords], table: StateTable) -> None:
        by_kind: dict[int, list[MetricRecords]] = {}
        for acc in accs:
            by_kind.setdefault(id(acc.kind), []).append(acc)
        self.groups = [Group(members) for members in by_kind.values()]
        self.members = [acc for group in self.groups for acc in group.members]
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
        ones = np.ones(len(rows))
        ones.flags.writeable = False
        self._numbers = NumbersOrder(list(numbers.rows), layout, batch_rows, ones)
        return self._numbers

    def number_rows(self, numbers: NumberRecords) -> np.ndarray:
        """Per flat number, its metric's place in this plan."""
        return self.index[np.fromiter(numbers.rows, np.int64, len(numbers.rows))]
