"""The host fold's batch: a ``Batch`` on numpy, with the host's fast paths.

A kind reads it through the ``Batch`` API (``rlmetrics.kinds.batch``) and gets what a
plain ``Batch`` would compute. What differs is how:

* ``BatchRows`` holds where the elements belong (the row of each element, the elements
  of each row and call), each derived once. A fold keeps the rows of its python numbers
  across steps (``rlmetrics._engine.plan``), so a steady-state step derives none of it
  again.
* A small batch sums by key (``np.bincount``); a large one by segment
  (``np.add.reduceat``), whose cost follows the rows, not the elements.
* A batch of bool masks keeps the mask as its selection. Its float64 weights are made
  only when read.
* Float32 values (the fold's join of float32 tensors) are widened only when read.
  Their unselected values are zeroed in place, and their sums widen element by
  element.
* The unselected values are zeroed when the values are first read. A max of the
  selected values reads only those (``HostBatch.column_max``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

import numpy as np

from rlmetrics.kinds.batch import Array, Batch

FEW_ROWS = 64
"""Rows up to which a large host batch counts each row's selected elements apart
(``np.count_nonzero`` per row) rather than by segment (a ``reduceat`` over bools)."""

SMALL = 1 << 14
"""Elements up to which a batch is small: its sums go by key (``np.bincount``, element
after element), where a large one's go by segment (``np.add.reduceat``, whose cost
grows with the rows, not the elements); see ``BatchRows.keyed``."""

_EMPTY: dict[np.ufunc, float] = {np.add: 0.0, np.maximum: -math.inf, np.minimum: math.inf}
"""Per segment reduction, its value for a segment without an element."""


class BatchRows:
    """Where a batch's elements belong, each fact computed once.

    A fold keeps the rows of its python numbers across steps, and the rows of its parts
    with them, so a steady-state step derives none of this again.

    Attributes:
        segments: int64, 1-D, the row of each element, ascending (on the batch's
            backend). Built when first read: a large host batch sums by segment from
            the row starts and never reads it.
        lengths: int64 host array, the number of elements of each row.
        call_lengths: int64 host array, the number of elements of each log call.
        num_rows: how many rows.
        keyed: whether the host sums of these rows go by key (a small batch) rather
            than by segment. The parts of a batch keep its choice, so every sum of one
            fold adds its elements alike: the same bits, whichever kind's code or part
            sums them.
    """

    __slots__ = (
        "_full",
        "_memo",
        "_place",
        "_segments",
        "_starts",
        "call_lengths",
        "keyed",
        "lengths",
        "num_rows",
    )

    def __init__(
        self,
        segments: Array | None,
        lengths: Sequence[int] | np.ndarray,
        call_lengths: Sequence[int] | np.ndarray,
        starts: np.ndarray | None = None,
        full: bool | None = None,
        keyed: bool | None = None,
        place: Callable[[np.ndarray], Array] | None = None,
    ) -> None:
        """``segments`` None: made from ``lengths`` when first read, put on the batch's
        backend by ``place`` (None: the host)."""
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self._segments = segments
        self._place = place
        if keyed is None:
            keyed = (len(segments) if segments is not None else int(self.lengths.sum())) <= SMALL
        self.keyed = keyed
        self.call_lengths = np.asarray(call_lengths, dtype=np.int64)
        self.num_rows = len(self.lengths)
        self._starts = starts
        self._full = full
        self._memo: dict[Any, Any] = {}  # what follows from the rows, by what it is

    @property
    def segments(self) -> Array:
        if self._segments is None:
            segments = np.arange(self.num_rows).repeat(self.lengths)  # no numpy wrapper
            self._segments = segments if self._place is None else self._place(segments)
        return self._segments

    def starts(self) -> np.ndarray:
        """Per row, the position of its first element (host array)."""
        if self._starts is None:
            self._starts = self.lengths.cumsum() - self.lengths
        return self._starts

    def full(self) -> bool:
        """Whether every row has an element."""
        if self._full is None:
            self._full = bool(self.lengths.all())
        return self._full

    def counts(self) -> np.ndarray:
        """Per row, its number of elements, float64.

        Read-only: the batches of these rows share it."""
        counts = self._memo.get("counts")
        if counts is None:
            counts = self._memo["counts"] = self.lengths.astype(np.float64)
            counts.flags.writeable = False
        return counts

    def last_index(self) -> np.ndarray:
        """Per row (all full), the position of its last element."""
        index = self._memo.get("last")
        if index is None:
            index = self._memo["last"] = self.starts() + (self.lengths - 1)
        return index

    def one_each(self) -> BatchRows:
        """The rows of a batch of one element per row."""
        rows = self._memo.get("one_each")
        if rows is None:
            index = np.arange(self.num_rows)
            ones = np.ones(self.num_rows, dtype=np.int64)
            rows = self._memo["one_each"] = BatchRows(index, ones, ones, index, True)
        return rows

    def part(self, rows: slice, elements: slice, calls: slice) -> BatchRows:
        """The rows ``rows``, numbered from 0, whose elements and calls are ``elements``
        and ``calls``; kept per slice of rows."""
        key = (rows.start, rows.stop)
        part = self._memo.get(key)
        if part is None:
            segments = self._segments
            if segments is not None:
                segments = segments[elements]
                segments = segments - rows.start if rows.start else segments
            starts = self._starts
            if starts is not None:
                starts = starts[rows] - elements.start if elements.start else starts[rows]
            part = self._memo[key] = BatchRows(
                segments,
                self.lengths[rows],
                self.call_lengths[calls],
                starts,
                True if self._full else None,  # a part of a full batch is full
                self.keyed,
                self._place,
            )
        return part


class HostBatch(Batch):
    """A host batch laid out by ``BatchRows``, with the fast paths of the module docstring.

    Args:
        values: float64 values; or float32 ones (the fold's scratch), with ``widened``.
        weights: float64 weights, or a bool mask (every call weighted by a mask or by
            nothing). A mask is the selection itself: its weight sums are counts and
            its weighted values are its values.
        rows: where the elements belong.
        widened: for float32 ``values``, a float64 buffer as large, which they are
            widened into when first read.
        owned: the values were made for this batch, so they may be zeroed in place.
        all_selected: every weight is > 0.
    """

    def __init__(
        self,
        values: np.ndarray,
        weights: np.ndarray,
        rows: BatchRows,
        *,
        widened: np.ndarray | None = None,
        owned: bool = False,
        all_selected: bool = False,
    ) -> None:
        self._values = values
        self._widened = widened
        self._narrow = widened is not None  # float32 values, not widened yet
        self._owned = owned
        self._zero_pending = False  # ``zero_unselected`` waits for the values' first read
        self._zeroed = False  # the unselected values are 0 (``zero_unselected`` ran)
        self._mask: np.ndarray | None = None  # the bool weights of a masked batch
        self._weights = weights
        if weights.dtype.kind == "b":  # a bool mask (the one boolean dtype)
            self._mask, self._weights = weights, None
        self.rows = rows
        self.lengths = rows.lengths
        self.call_lengths = rows.call_lengths
        self.num_rows = rows.num_rows
        self._selected = self._mask
        self._count = None
        if all_selected:
            self.all_selected = True

    @property
    def values(self) -> Array:
        values = self._zeroed_values() if self._zero_pending else self._values
        if self._narrow:  # float32 values: widened into their buffer, once
            assert self._widened is not None  # a narrow batch is made with one
            self._widened[...] = values
            self.values = values = self._widened
        return values

    @values.setter
    def values(self, values: Array) -> None:
        self._values, self._zero_pending, self._narrow = values, False, False

    def _zeroed_values(self) -> Array:
        """The values, the unselected ones zeroed once ``zero_unselected`` asked for it.

        Float32 ones are not widened: ``column_sum`` widens them element by element."""
        if self._zero_pending:
            self._zero_pending = False
            self._zero()
        return self._values

    @property
    def weights(self) -> Array:
        if self._weights is None:
            self._weights = self.as_float(self._mask)
        return self._weights

    @weights.setter
    def weights(self, weights: Array) -> None:
        self._weights, self._mask, self._selected, self._count = weights, None, None, None

    @property
    def segments(self) -> Array:
        return self.rows.segments

    def part(self, rows: slice, elements: slice, calls: slice) -> HostBatch:
        weights = self.weights if self._mask is None else self._mask
        widened = None if self._widened is None else self._widened[elements]
        part = HostBatch(
            self._values[elements],
            weights[elements],
            self.rows.part(rows, elements, calls),
            widened=widened,
            owned=self._owned,
            all_selected=self.all_selected,
        )
        part._zeroed, part._zero_pending = self._zeroed, self._zero_pending
        part._narrow = self._narrow
        if not self.all_selected:
            part._selected = self.selected()[elements]
        return part

    def row_starts(self) -> np.ndarray:
        return self.rows.starts()

    def rows_full(self) -> bool:
        return self.rows.full()

    def count(self) -> Array:
        if self._count is None:
            self._count = self.rows.counts() if self.all_selected else self._counted()
        return self._count

    def _counted(self) -> Array:
        """``count``'s work for a batch with unselected elements."""
        if not self.rows.keyed and self.num_rows <= FEW_ROWS:
            selected, starts = self.selected(), self.row_starts()
            ends = (starts + self.lengths).tolist()
            return np.array(
                [
                    np.count_nonzero(selected[a:b])
                    for a, b in zip(starts.tolist(), ends, strict=True)
                ],
                dtype=np.float64,
            )
        return self.sum_by(self.selected())

    def column(self, name: str) -> Array:
        masked = name == "weighted_value" and self._mask is not None
        if masked and (self._zeroed or self.all_selected):
            # a mask's weight is 1 where selected, and a value elsewhere is 0 (or there
            # is none): the weighted values are the values
            return self.values
        return super().column(name)

    def column_sum(self, name: str) -> Array:
        if name == "weight" and self._mask is not None:
            return self.count()
        if not self.one_per_row and name != "selected":
            masked = (  # the weighted values are the values (``column``)
                name == "weighted_value"
                and self._mask is not None
                and (self._zeroed or self.all_selected)
            )
            if self._narrow and (name == "value" or masked):
                # float32 values, zeroed where not selected (the weighted value of a mask):
                # summed as float64 element by element, the sums of the widened values
                sums = self._masked_sums() if masked and self._zero_pending else None
                return self.sum_by(self._zeroed_values()) if sums is None else sums
            if masked:  # the sums of ``column``'s values, without its calls
                return self.sum_by(self.values)
        return super().column_sum(name)

    def _masked_sums(self) -> np.ndarray | None:
        """Per row, the sum of its selected float32 values in float64, in one pass that
        leaves the values as they are: each value times its mask, summed in float64
        (``np.einsum``), where zeroing them first and summing after takes three.

        Only up to ``FEW_ROWS`` rows summed by segment. None where a sum is not finite:
        an unselected NaN or infinity times 0 is NaN, so the zeroing decides then."""
        mask = self._mask
        if mask is None or self.rows.keyed or self.num_rows > FEW_ROWS:
            return None
        values, starts = self._values, self.row_starts()
        bounds = zip(starts.tolist(), (starts + self.lengths).tolist(), strict=True)
        sums = np.array(
            [np.einsum("i,i->", values[a:b], mask[a:b], dtype=np.float64) for a, b in bounds],
            dtype=np.float64,
        )
        return sums if np.isfinite(sums).all() else None

    def column_max(self, name: str) -> Array:
        if not self.all_selected and name in ("value", "negated_value"):
            return self._max_of_selected(negate=name == "negated_value")
        return super().column_max(name)

    def _max_of_selected(self, negate: bool) -> np.ndarray:
        """Per row, the max of the selected values (negated: the negated min).

        The selected values are laid together (``np.compress``) and reduced by segment.
        That costs less than a ``where`` that replaces the others by -inf."""
        kept = np.compress(self.selected(), self._values)  # zeroed or not: the same
        counts = self.count().astype(np.int64)
        nonempty = None if counts.all() else counts > 0
        starts = counts.cumsum() - counts
        starts = starts if nonempty is None else starts[nonempty]
        if negate:
            return -_by_segments(np.minimum, kept, starts, nonempty, self.num_rows)
        return _by_segments(np.maximum, kept, starts, nonempty, self.num_rows)

    def sum_by(self, x: Array, keys: Array | None = None, size: int | None = None) -> Array:
        """As ``Batch.sum_by``. A large batch (``BatchRows.keyed`` false) sums each row as
        one ``reduceat`` segment, in float64 whatever the dtype of ``x`` (bool counts).
        Its rounding differs from an element-by-element sum only as any other split of
        the row's elements would."""
        if keys is None:
            rows = self.rows
            if not rows.keyed:
                return self._by_row(np.add, x)
            # ``Batch.sum_by`` written out: every segment is below num_rows
            return np.bincount(rows.segments, weights=x, minlength=rows.num_rows)
        return super().sum_by(x, keys, size)

    def max_by(self, x: Array) -> Array:
        return self._by_row(np.maximum, x)

    def _by_row(self, ufunc: np.ufunc, x: Array) -> Array:
        """Per row, ``ufunc`` over its elements (see ``_by_segments``)."""
        rows = self.rows
        nonempty = None if rows.full() else self.lengths > 0
        starts = rows.starts() if nonempty is None else rows.starts()[nonempty]
        return _by_segments(ufunc, x, starts, nonempty, self.num_rows)

    def zero_unselected(self) -> None:
        """As ``Batch.zero_unselected``, done when the values are first read.

        A max of the selected values reads only those (``_max_of_selected``)."""
        if not self.all_selected:
            self._zero_pending, self._zeroed = True, True

    def _zero(self) -> None:
        """``zero_unselected``'s work: a product with the selection where every value is
        finite, else a ``where``.

        A finite sum tells, for less than a pass of its own: any NaN or infinity, or a
        sum past the dtype's range, makes it non-finite. The product runs in place for
        float32 values (the fold's own buffer) and for values the fold made."""
        values, selected = self._values, self.selected()
        if math.isfinite(np.add.reduce(values)):
            out = values if self._owned or self._narrow else None
            self._values = np.multiply(values, selected, out=out)  # narrow ones stay so
        else:
            self.values = np.where(selected, values.astype(np.float64, copy=False), 0.0)
        self._zeroed = True

    def _last_index(self) -> np.ndarray:
        return self.rows.last_index()

    def _one_each(self, values: Array, weights: Array) -> HostBatch:
        return HostBatch(values, weights, self.rows.one_each())


def _by_segments(
    ufunc: np.ufunc, x: np.ndarray, starts: np.ndarray, nonempty: Any, size: int
) -> np.ndarray:
    """Per key in ``range(size)``, ``ufunc`` over its elements, in float64.

    The elements of each key lie together in ascending order of keys. The keys with an
    element (``nonempty``; None: all) start at ``starts``. A key without one gets 0 for
    ``np.add``, -inf for ``np.maximum``, inf for ``np.minimum``; NaN wins. A segment's
    order of additions depends on its elements only, not on where they lie. Up to
    ``FEW_ROWS`` segments are summed one by one (``np.add.reduce``, pairwise): twice as
    fast per element as ``reduceat``, and as exact or more."""
    if nonempty is None:
        return _segments(ufunc, x, starts)
    out = np.full(size, _EMPTY[ufunc])
    if len(starts):
        out[nonempty] = _segments(ufunc, x, starts)
    return out


def _segments(ufunc: np.ufunc, x: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``ufunc`` over each segment of ``x`` from one of ``starts`` (ascending, each
    segment non-empty) to the next, in float64."""
    if ufunc is not np.add or len(starts) > FEW_ROWS:
        return ufunc.reduceat(x, starts, dtype=np.float64)
    bounds = [*starts.tolist(), len(x)]
    reduce = np.add.reduce
    return np.array(
        [reduce(x[a:b], dtype=np.float64) for a, b in pairwise(bounds)],
        dtype=np.float64,
    )
