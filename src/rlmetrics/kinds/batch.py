"""A step's records of one kind, as the flat arrays a kind reduces in one pass.

The framework concatenates every call of every metric of a kind on one backend (host
data with numpy, each device with torch) into a ``Batch``: values and weights in call
order, metric by metric, and the metric (row) of each element. A kind's ``reduce``
turns a batch into per-metric state rows with a fixed number of array operations,
however many calls and metrics there were, through the segment operations below; the
same code runs on numpy arrays and on tensors of any device. Where the elements belong
(``BatchRows``: the row of each element, the elements of each row and call) is derived
once per set of rows: a fold keeps the rows of its python numbers across steps
(``rlmetrics._engine.plan``), so a steady-state step derives none of it again.

The framework's rules are applied before a kind sees the batch: an element whose weight
is 0 (deselected, in a rejected call, or non-finite under ``nonfinite="skip"``) has
weight 0 and value 0, so no NaN hides behind a zero weight.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

Array = Any  # np.ndarray on the host, torch.Tensor on a device

FEW_ROWS = 64
"""Rows up to which a large host batch counts each row's selected elements apart
(``np.count_nonzero`` per row) rather than by segment (a ``reduceat`` over bools)."""

SMALL = 1 << 14
"""Elements up to which a batch is small: its sums go by key (``np.bincount``, element
after element), where a large one's go by segment (``np.add.reduceat``, whose cost
grows with the rows, not the elements); see ``BatchRows.keyed``."""


class BatchRows:
    """Where a batch's elements belong: the row of each element, the elements of each
    row and of each call, and what follows from them, each computed once. A fold keeps
    the rows of its python numbers across steps, and the rows of its parts with them,
    so a steady-state step derives none of this again.

    Attributes:
        segments: int64, 1-D, the row of each element, ascending (on the batch's
            backend); built when first read (a large host batch sums by segment from
            the row starts and never reads it).
        lengths: int64 host array, the number of elements of each row.
        call_lengths: int64 host array, the number of elements of each log call.
        num_rows: how many rows.
        keyed: whether the host sums of these rows go by key (a small batch) rather
            than by segment; the parts of a batch keep its choice, so that every sum
            of one fold adds its elements alike (the same bits, whichever kind's code
            or part sums them).
    """

    __slots__ = (
        "_full", "_memo", "_place", "_segments", "_starts", "call_lengths", "keyed", "lengths",
        "num_rows",
    )  # fmt: skip

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
            segments = np.repeat(np.arange(self.num_rows), self.lengths)
            self._segments = segments if self._place is None else self._place(segments)
        return self._segments

    def starts(self) -> np.ndarray:
        """Per row, the position of its first element (host array)."""
        if self._starts is None:
            self._starts = np.cumsum(self.lengths) - self.lengths
        return self._starts

    def full(self) -> bool:
        """Whether every row has an element."""
        if self._full is None:
            self._full = bool(self.lengths.all())
        return self._full

    def counts(self) -> np.ndarray:
        """Per row, its number of elements, float64 (read-only: shared by the batches
        of these rows)."""
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

    def one_each(self, constant: Any) -> BatchRows:
        """The rows of a batch of one element per row (``constant`` puts a host array
        on the backend of these rows' segments)."""
        rows = self._memo.get("one_each")
        if rows is None:
            index = np.arange(self.num_rows)
            ones = np.ones(self.num_rows, dtype=np.int64)
            rows = self._memo["one_each"] = BatchRows(constant(index), ones, ones, index, True)
        return rows

    def part(self, rows: slice, elements: slice, calls: slice) -> BatchRows:
        """The rows ``rows`` (whose elements and calls are ``elements`` and ``calls``),
        numbered from 0; kept per slice of rows."""
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


COLUMNS = ("value", "negated_value", "weight", "weighted_value", "selected")
"""The per-element columns a kind can declare its slots with (``Batch.column``): the
value, its negation, the weight, value × weight, and 1 where selected (weight > 0). A
SUM slot sums its column over a metric's elements (one that is not selected has value
and weight 0 by then: it adds nothing); a MAX slot takes its column's max over the
selected elements (-inf when there is none)."""


_EMPTY: dict[np.ufunc, float] = {np.add: 0.0, np.maximum: -math.inf, np.minimum: math.inf}
"""Per segment reduction, its value for a segment without an element."""


class Batch:
    """One backend's records of one kind (see the module docstring).

    Attributes:
        values: float64, 1-D, every element in call order, metric by metric.
        weights: float64, 1-D, the elements' weights (> 0: selected). A host batch
            may be made with a bool mask instead (every call weighted by a mask or by
            nothing): it is then the selection itself, its weight sums are counts and
            its weighted values are its values, and the float64 weights are made only
            when read.
        segments: int64, 1-D, the row (metric) of each element, ascending.
        lengths: int64 host array, the number of elements of each row.
        call_lengths: int64 host array, the number of elements of each log call, in
            order.
        num_rows: how many metrics the batch holds.

    A batch and its arrays are valid while the fold that made it runs: a host fold
    writes its large arrays into buffers the next fold writes over
    (``rlmetrics._engine.plan.HostScratch``). So what a kind keeps beyond its reduce (its
    extras) is new: ``split`` hands out pieces it may keep, and the reductions are new
    arrays; a view of ``values``, ``weights`` or ``selected()`` is not.
    """

    on_host: bool = True
    xp: Any = np  # the array namespace: numpy here, torch on a device
    all_selected: bool = False  # every weight is > 0 (the fold's batches of python numbers)
    one_per_row: bool = False  # one element per row (``last_elements``)

    def __init__(
        self,
        values: Array,
        weights: Array,
        segments: Array,
        lengths: Sequence[int] | np.ndarray,
        call_lengths: Sequence[int] | np.ndarray,
    ) -> None:
        self._set(values, weights, BatchRows(segments, lengths, call_lengths))

    @classmethod
    def of(cls, values: Array, weights: Array, rows: BatchRows) -> Batch:
        """A batch of ``values`` and ``weights`` laid out as ``rows``."""
        batch = object.__new__(cls)
        batch._set(values, weights, rows)
        return batch

    def _set(self, values: Array, weights: Array, rows: BatchRows) -> None:
        self._values = values
        self._narrow = False  # float32 host values, widened into ``_widened`` when first read
        self._widened: np.ndarray | None = None
        self._zero_pending = False  # ``zero_unselected`` waits for the values' first read
        self._owned = False  # the values may be zeroed in place
        self._mask: np.ndarray | None = None  # the bool weights of a masked host batch
        self._weights: Array | None = weights
        if isinstance(weights, np.ndarray) and weights.dtype == np.bool_:
            self._mask, self._weights = weights, None
        self.rows = rows
        self.lengths = rows.lengths
        self.call_lengths = rows.call_lengths
        self.num_rows = rows.num_rows
        self._selected: Array | None = self._mask
        self._zeroed = False  # the unselected values are 0 (``zero_unselected`` ran)
        self._count: Array | None = None

    @classmethod
    def _of_narrow(
        cls, values: np.ndarray, weights: Array, rows: BatchRows, widened: np.ndarray
    ) -> Batch:
        """A host batch of float32 ``values`` (the fold's join of float32 tensors, its
        own buffer), widened into ``widened`` (as many elements) only when ``values`` is
        read: the unselected values are zeroed in place, a sum widens element by element
        (``column_sum``) and a max of the selected values reads them as they are."""
        batch = cls.of(values, weights, rows)
        batch._narrow, batch._widened = True, widened
        return batch

    @property
    def values(self) -> Array:
        values = self._zeroed_values()
        if self._narrow:  # float32 values: widened into their buffer, once
            assert self._widened is not None  # a narrow batch is made with one
            self._widened[...] = values
            self.values = values = self._widened
        return values

    @values.setter
    def values(self, values: Array) -> None:
        self._values, self._zero_pending, self._narrow = values, False, False

    def _zeroed_values(self) -> Array:
        """The values, the unselected ones zeroed once ``zero_unselected`` asked for it;
        float32 ones not widened (the sums of ``column_sum`` widen element by element)."""
        if self._zero_pending:
            self._zero_pending = False
            self._zero(self._owned)
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

    def part(self, rows: slice, elements: slice, calls: slice) -> Batch:
        """The batch of ``rows`` (whose elements and calls are ``elements`` and
        ``calls``), its rows numbered from 0: the metrics of one kind."""
        weights = self.weights if self._mask is None else self._mask
        part = self.of(
            self._values[elements], weights[elements], self.rows.part(rows, elements, calls)
        )
        part._zeroed, part._zero_pending = self._zeroed, self._zero_pending
        part._owned, part._narrow = self._owned, self._narrow
        if self._widened is not None:
            part._widened = self._widened[elements]
        if self.all_selected:
            part.all_selected = True
        else:
            part._selected = self.selected()[elements]
        return part

    def row_starts(self) -> np.ndarray:
        """Per row, the position of its first element (host array)."""
        return self.rows.starts()

    def rows_full(self) -> bool:
        """Whether every row has an element."""
        return self.rows.full()

    # -- operations a kind's reduce uses ---------------------------------------------
    def selected(self) -> Array:
        """Bool per element: weight > 0."""
        if self._selected is None:
            self._selected = self.weights > 0
        return self._selected

    def count(self) -> Array:
        """Per row, the number of selected elements (float64; kept once counted)."""
        if self._count is None:
            self._count = self._counted()
        return self._count

    def _counted(self) -> Array:
        if self.all_selected:
            return self.rows.counts()
        if self.on_host and not self.rows.keyed and self.num_rows <= FEW_ROWS:
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
        """A per-element column by its name in ``COLUMNS`` (what a kind's declared
        slots are made of: see ``Kind.sum_columns``)."""
        if name == "value":
            return self.values
        if name == "negated_value":
            return -self.values
        if name == "weight":
            return self.weights
        if name == "weighted_value":
            if self._mask is not None and self._zeroed:
                return self.values  # a weight of 1 where selected, a 0 value elsewhere
            return self.values * self.weights
        if name == "selected":
            return self.as_float(self.selected())
        raise ValueError(f"unknown column {name!r}; columns: {', '.join(COLUMNS)}")

    def column_sum(self, name: str) -> Array:
        """Per row, the sum of the column ``name`` over the row's elements."""
        if name == "selected" or (name == "weight" and self._mask is not None):
            return self.count()
        if self.one_per_row:
            return self.column(name)  # as it is: a sum would turn -0.0 into 0.0
        masked = name == "weighted_value" and self._mask is not None and self._zeroed
        if self._narrow and (name == "value" or masked):
            # float32 values, zeroed where not selected (the weighted value of a mask):
            # summed as float64 element by element, the sums of the widened values
            return self.sum_by(self._zeroed_values())
        return self.sum_by(self.column(name))

    def column_max(self, name: str) -> Array:
        """Per row, the max of the column ``name`` over the row's selected elements
        (-inf for none; NaN wins)."""
        if self.on_host and not self.all_selected and name in ("value", "negated_value"):
            return self._max_of_selected(negate=name == "negated_value")
        column = self.select(self.column(name), -math.inf)
        return column if self.one_per_row else self.max_by(column)

    def _max_of_selected(self, negate: bool) -> np.ndarray:
        """Per row, the max of the selected values (negated: of their negations, the
        negated min), from the selected values alone, laid together (``np.compress``),
        rather than from every value with the others replaced by -inf (a ``where``,
        which costs more than the copy of the selected ones)."""
        kept = np.compress(self.selected(), self._values)  # zeroed or not: the same
        counts = self.count().astype(np.int64)
        nonempty = None if counts.all() else counts > 0
        starts = np.cumsum(counts) - counts
        starts = starts if nonempty is None else starts[nonempty]
        if negate:
            return -self._by_segments(np.minimum, kept, starts, nonempty, self.num_rows)
        return self._by_segments(np.maximum, kept, starts, nonempty, self.num_rows)

    def column_sums(self, names: Sequence[str]) -> Array:
        """``column_sum`` of each of ``names``, laid end to end (num_rows values each)."""
        return self._joined([self.column_sum(name) for name in names])

    def column_maxes(self, names: Sequence[str]) -> Array:
        """``column_max`` of each of ``names``, laid end to end."""
        return self._joined([self.column_max(name) for name in names])

    def _joined(self, per_row: list[Array]) -> Array:
        """Per-row arrays laid end to end (an empty float64 array for none)."""
        if len(per_row) == 1:
            return per_row[0]
        return self.xp.concatenate(per_row) if per_row else self.constant(np.zeros(0))

    def select(self, x: Array, fill: float) -> Array:
        """``x`` where an element is selected, ``fill`` elsewhere."""
        return x if self.all_selected else self.where(self.selected(), x, fill)

    def sum_by(self, x: Array, keys: Array | None = None, size: int | None = None) -> Array:
        """Per row, the sum of ``x`` over the row's elements (0 for an empty row); with
        ``keys``, the sums of ``x`` by key in ``range(size)`` instead.

        A large batch (``BatchRows.keyed`` false) sums each row as one ``reduceat`` segment
        (its elements lie together), in float64 whatever the dtype of ``x`` (bool
        counts); its rounding differs from an element-by-element sum only as any other
        split of the row's elements would."""
        if keys is None:
            if not self.rows.keyed:
                return self._by_row(np.add, x)
            keys, size = self.segments, self.num_rows
        elif size is None:
            raise TypeError("sum_by: keys take a size")
        return np.bincount(keys, weights=x, minlength=size)[:size]

    def zero_unselected(self) -> None:
        """Give the elements that are not selected the value 0, so that no arithmetic
        on them (``NaN * 0`` is NaN) reaches a sum. Done when the values are first
        read: a max of the selected values reads only those (``_max_of_selected``)."""
        self._zero_unselected(in_place=False)

    def _zero_unselected(self, in_place: bool) -> None:
        """``zero_unselected``; ``in_place``: the values are the batch's own (made for
        it by the fold) and may be written over."""
        if not self.all_selected:
            self._zero_pending, self._owned, self._zeroed = True, in_place, True

    def _zero(self, in_place: bool) -> None:
        """``zero_unselected``'s work, on the host: a product with the selection where
        every value is finite (a finite sum tells, for less than a pass of its own: any
        NaN or infinity, or a sum past the dtype's range, makes it non-finite), in place
        for float32 values (the fold's own buffer) and values the fold made."""
        values, selected = self._values, self.selected()
        if math.isfinite(np.add.reduce(values)):
            out = values if in_place or self._narrow else None
            self._values = np.multiply(values, selected, out=out)  # narrow ones stay so
        else:
            self.values = np.where(selected, values.astype(np.float64, copy=False), 0.0)
        self._zeroed = True

    def max_by(self, x: Array) -> Array:
        """Per row, the max of ``x`` (NaN wins; -inf for an empty row)."""
        return self._by_row(np.maximum, x)

    def _by_row(self, ufunc: np.ufunc, x: Array) -> Array:
        """Per row, ``ufunc`` over its elements (see ``_by_segments``)."""
        rows = self.rows
        nonempty = None if rows.full() else self.lengths > 0
        starts = rows.starts() if nonempty is None else rows.starts()[nonempty]
        return self._by_segments(ufunc, x, starts, nonempty, self.num_rows)

    @staticmethod
    def _by_segments(
        ufunc: np.ufunc, x: np.ndarray, starts: np.ndarray, nonempty: Any, size: int
    ) -> np.ndarray:
        """Per key in ``range(size)``, ``ufunc`` (``np.add``: 0 for a key without an
        element; ``np.maximum``: -inf for none, ``np.minimum``: inf; NaN wins) over its
        elements, in float64:
        the elements of each key lie together in ascending order of keys, the keys with
        an element (``nonempty``; None: all) start at ``starts``. A segment's sum is
        added in ``reduceat``'s order, which depends on its elements only, not on where
        they lie."""
        if nonempty is None:
            return ufunc.reduceat(x, starts, dtype=np.float64)
        out = np.full(size, _EMPTY[ufunc])
        if len(starts):
            out[nonempty] = ufunc.reduceat(x, starts, dtype=np.float64)
        return out

    def last_elements(self) -> Batch:
        """A batch of each row's last selected element (one element per row; an
        unselected zero for a row without one): what a replacing kind reduces."""
        full = self.all_selected and self.rows_full()
        if full:  # every row's last element
            index = self.rows.last_index()
            values, weights = self.values[index], self.weights[index]
        else:
            last = self.max_by(self.select(self.positions(), -1.0))
            present = last >= 0
            values = self.where(present, self.take(self.values, last), 0.0)
            weights = self.where(present, self.take(self.weights, last), 0.0)
        out = self.of(values, weights, self.rows.one_each(self.constant))
        out.all_selected = full
        out.one_per_row = True
        return out

    def chunk_index(self, parts: int) -> Array:
        """Per element, which of ``parts`` equal chunks of its call it falls in (calls
        hold a multiple of ``parts`` elements: see ``Kind.parts``)."""
        lengths = self.call_lengths
        starts = np.cumsum(lengths) - lengths
        position = np.arange(int(lengths.sum())) - np.repeat(starts, lengths)
        chunk = np.repeat(np.maximum(-(-lengths // parts), 1), lengths)
        return self.constant(position // chunk)

    def constant(self, array: np.ndarray) -> Array:
        """A host array on this batch's backend."""
        return array

    def as_float(self, x: Array) -> Array:
        """``x`` (bool, int...) as float64."""
        return x.astype(np.float64)

    def zeros(self, size: int) -> Array:
        """``size`` float64 zeros on this batch's backend."""
        return np.zeros(size)

    def by_row(self, per_row: Array) -> Array:
        """A per-row array spread to the rows' elements."""
        return per_row[self.segments]

    def where(self, condition: Array, a: Any, b: Any) -> Array:
        return self.xp.where(condition, a, b)

    def isfinite(self, x: Array) -> Array:
        return self.xp.isfinite(x)

    def columns(self, *columns: Array) -> Array:
        """Per-row columns as a (rows, len(columns)) state block."""
        if len(columns) == 1:
            return np.asarray(columns[0], dtype=np.float64)[:, None]
        if not columns:
            return np.zeros((self.num_rows, 0))
        return np.array(columns, dtype=np.float64).T

    def concat(self, *blocks: Array) -> Array:
        """(rows, k) state blocks side by side."""
        return self.xp.concatenate(blocks, axis=1)

    def split(self, x: Array) -> list[Array]:
        """``x`` cut into its rows' pieces, which a kind may keep (its extras): on the
        host, views of a copy of ``x``, since ``x`` may be (a view of) a buffer the next
        fold writes over."""
        return np.split(np.array(x), np.cumsum(self.lengths[:-1]))

    def positions(self) -> Array:
        return np.arange(len(self.values), dtype=np.float64)

    def take(self, x: Array, index: Array) -> Array:
        """``x`` at float positions ``index`` (negative ones read element 0)."""
        if len(x) == 0:
            return np.zeros(len(index))
        return x[np.maximum(index, 0).astype(np.int64)]

    def searchsorted(self, edges: Sequence[float], x: Array, right: bool = False) -> Array:
        """Bin indices of ``x`` among ``edges``, as ``np.searchsorted``."""
        return np.searchsorted(np.asarray(edges, dtype=np.float64), x, "right" if right else "left")


class DeviceBatch(Batch):
    """A batch of tensors on one device (no host sync in any operation)."""

    on_host = False
    xp = torch

    def sum_by(self, x: Tensor, keys: Tensor | None = None, size: int | None = None) -> Tensor:
        if keys is None:
            keys, size = self.segments, self.num_rows
        elif size is None:
            raise TypeError("sum_by: keys take a size")
        out = torch.zeros(size, dtype=torch.float64, device=self.values.device)
        return out.index_add_(0, keys, x.to(torch.float64))

    def constant(self, array: np.ndarray) -> Tensor:
        return to_device(array, self.values.device)

    def as_float(self, x: Tensor) -> Tensor:
        return x.to(torch.float64)

    def zeros(self, size: int) -> Tensor:
        return torch.zeros(size, dtype=torch.float64, device=self.values.device)

    def _zero_unselected(self, in_place: bool) -> None:
        if not self.all_selected:  # no check for non-finite values: it would wait for them
            self.values = torch.where(self.selected(), self.values, 0.0)
            self._zeroed = True

    def max_by(self, x: Tensor) -> Tensor:
        out = torch.full((self.num_rows,), -math.inf, dtype=torch.float64, device=x.device)
        return out.scatter_reduce_(0, self.segments, x.to(torch.float64), "amax")

    def columns(self, *columns: Tensor) -> Tensor:
        if not columns:
            return torch.zeros((self.num_rows, 0), dtype=torch.float64, device=self.values.device)
        return torch.stack([c.to(torch.float64) for c in columns], dim=1)

    def split(self, x: Tensor) -> list[Tensor]:
        """``x`` cut into its rows' pieces, views (a device fold's arrays are its own)."""
        return list(x.split(self.lengths.tolist()))

    def positions(self) -> Tensor:
        return torch.arange(len(self.values), dtype=torch.float64, device=self.values.device)

    def take(self, x: Tensor, index: Tensor) -> Tensor:
        if len(x) == 0:
            return torch.zeros_like(index)
        return x[index.clamp(min=0).long()]

    def searchsorted(self, edges: Sequence[float], x: Tensor, right: bool = False) -> Tensor:
        bounds = self.constant(np.asarray(edges, dtype=np.float64))
        return torch.bucketize(x, bounds, right=right)


def to_device(array: np.ndarray, device: torch.device) -> Tensor:
    """A host array on ``device`` without waiting for the device: a CUDA copy goes
    through pinned memory, asynchronously (a pageable copy would wait for the stream)."""
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
