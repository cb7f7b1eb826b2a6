"""Which metrics a fold reduces, grouped by kind, and where their elements go.

A ``Plan`` orders the metrics of one fold (the host's or one device's) kind by kind;
each kind's metrics reduce as one slice of the batch, except the columnar kinds
(``Kind.columnar``), which come first and reduce together (``Fused``). A ``Layout``
puts the records' elements and calls into that order (a stable sort by metric) and
says where each metric's begin. Both are kept across steps while the same metrics come
back (``rlmetrics._engine.plan.StepPlan.fold_plan``; a plan keeps the layout of its
flat numbers while their row list is the same).
"""

from __future__ import annotations

from itertools import accumulate
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np

from rlmetrics._engine.record import NumberRecords
from rlmetrics._engine.table import Table
from rlmetrics.kinds.base import Accumulator
from rlmetrics.kinds.rows import Rows

_get_row = attrgetter("row")

FUSED = -1
"""``Plan.positions``'s key for the columnar groups reduced together."""


class Layout(NamedTuple):
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
    ) -> Layout:
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
        return Layout._of(order, rows, lengths, row_calls, call_rows, call_lengths)

    @staticmethod
    def of_sorted(
        rows: np.ndarray,
        lengths: np.ndarray,
        calls: np.ndarray,
        call_lengths: list[int],
        num_rows: int,
    ) -> Layout:
        """The layout of records already in plan order: the metrics at plan rows ``rows``
        (ascending, each once) hold ``lengths`` elements in ``calls`` calls each, and the
        calls, in order, hold ``call_lengths`` elements."""
        row_lengths = np.zeros(num_rows, dtype=np.int64)
        row_lengths[rows] = lengths
        row_calls = np.zeros(num_rows, dtype=np.int64)
        row_calls[rows] = calls
        segments, call_rows = np.repeat(rows, lengths), np.repeat(rows, calls)
        call_sizes = np.asarray(call_lengths, dtype=np.int64)
        return Layout._of(None, segments, row_lengths, row_calls, call_rows, call_sizes)

    @staticmethod
    def _of(
        order: np.ndarray | None,
        segments: np.ndarray,
        lengths: np.ndarray,
        row_calls: np.ndarray,
        call_rows: np.ndarray,
        call_lengths: np.ndarray,
    ) -> Layout:
        ends = np.cumsum(lengths)
        element_at = [0, *ends.tolist()]
        call_at = [0, *np.cumsum(row_calls).tolist()]
        starts, full = ends - lengths, bool(lengths.all())
        return Layout(
            order, segments, lengths, starts, full, element_at, call_at, call_rows, call_lengths
        )


class NumbersLayout(NamedTuple):
    """The layout of a step's flat python numbers, kept while their row list is the
    same: the elements' plan order, the batch's rows, and the weights when none was
    logged (all 1; read-only)."""

    rows: list[int]  # per number, its table row, as recorded
    layout: Layout
    batch_rows: Rows
    unit_weights: np.ndarray


class Group:
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


class Fused(NamedTuple):
    """How the leading columnar groups of a plan reduce together: each column once over
    the elements of the groups that declare it (its ``*_spans``: the plan rows from the
    first such group to the last), one value per plan row, then each slot of each row
    read from its column's row (``*_source``, into the columns' per-row values laid end
    to end) into its table position (``*_positions``)."""

    num_rows: int  # the plan rows of the columnar groups: 0 .. num_rows - 1
    sum_columns: list[str]
    sum_spans: list[tuple[int, int]]
    sum_source: np.ndarray
    sum_positions: np.ndarray
    max_columns: list[str]
    max_spans: list[tuple[int, int]]
    max_source: np.ndarray
    max_positions: np.ndarray

    @staticmethod
    def make(groups: list[Group], table: Table) -> Fused:
        num_rows = sum(len(group.members) for group in groups)
        made: list[Any] = []
        for slots in (1, 2):  # the SUM, then the MAX slots (``Group.positions``' order)
            spans: dict[str, tuple[int, int]] = {}  # per column, in order of first use
            sources, positions = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
            first = 0
            for group in groups:
                kind, at = group.kind, group.positions(table)[slots]
                last = first + len(group.members)
                for j, name in enumerate(kind.sum_columns if slots == 1 else kind.max_columns):
                    column = list(spans).index(name) if name in spans else len(spans)
                    spans[name] = (spans.get(name, (first, last))[0], last)
                    sources.append(column * num_rows + np.arange(first, last))
                    positions.append(at[:, j])
                first = last
            made += [list(spans), list(spans.values())]
            made += [np.concatenate(sources), np.concatenate(positions)]
        return Fused(num_rows, *made)


class Plan:
    """The metrics of one fold grouped by kind (``members`` in that order, the columnar
    kinds first), and where each table row's metric is in that order (``index``: -1 for
    a row not in it)."""

    def __init__(self, accs: list[Accumulator], table: Table) -> None:
        by_kind: dict[int, list[Accumulator]] = {}
        for acc in accs:
            by_kind.setdefault(id(acc.kind), []).append(acc)
        self.groups = [Group(members) for members in by_kind.values()]
        self.groups.sort(key=lambda group: not group.kind.columnar)  # stable
        self.num_columnar = sum(group.kind.columnar for group in self.groups)
        self._fused: Fused | None = None
        self.members = [acc for group in self.groups for acc in group.members]
        self.bounds = list(accumulate((len(group.members) for group in self.groups), initial=0))
        self.rows = np.fromiter(map(_get_row, self.members), np.int64, len(self.members))
        self.index = np.full(table.num_rows, -1, dtype=np.int64)
        self.index[self.rows] = np.arange(len(self.rows))
        self._numbers: NumbersLayout | None = None
        self._positions: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}

    def fused(self, table: Table) -> Fused:
        """How the columnar groups (the first ``num_columnar``) reduce together."""
        if self._fused is None:
            self._fused = Fused.make(self.groups[: self.num_columnar], table)
        return self._fused

    def positions(self, groups: tuple[int, ...], table: Table) -> tuple[np.ndarray, np.ndarray]:
        """The SUM and MAX positions of the rows of ``groups`` (indices into
        ``self.groups``; ``FUSED`` for the columnar groups as ``Fused`` orders their
        slots), flat, in order; kept per set of groups."""
        cached = self._positions.get(groups)
        if cached is None:
            sums, maxes = [], []
            for i in groups:
                if i == FUSED:
                    fused = self.fused(table)
                    sums.append(fused.sum_positions)
                    maxes.append(fused.max_positions)
                else:
                    _, sum_positions, max_positions = self.groups[i].positions(table)
                    sums.append(sum_positions.reshape(-1))
                    maxes.append(max_positions.reshape(-1))
            cached = self._positions[groups] = (np.concatenate(sums), np.concatenate(maxes))
        return cached

    def numbers_layout(self, numbers: NumberRecords) -> NumbersLayout:
        """The layout of the flat ``numbers``; the last one is kept, since a
        steady-state step logs its metrics in the same order every time."""
        cached = self._numbers
        if cached is not None and cached.rows == numbers.rows:
            return cached
        rows = self.number_rows(numbers)
        calls = np.ones(len(rows), dtype=np.int64)  # one element per call
        layout = Layout.make(rows, rows, calls, len(self.rows))
        batch_rows = Rows(layout.segments, layout.lengths, calls, layout.starts, layout.full)
        ones = np.ones(len(rows))
        ones.flags.writeable = False
        self._numbers = NumbersLayout(list(numbers.rows), layout, batch_rows, ones)
        return self._numbers

    def number_rows(self, numbers: NumberRecords) -> np.ndarray:
        """Per flat number, its metric's place in this plan."""
        return self.index[np.fromiter(numbers.rows, np.int64, len(numbers.rows))]
