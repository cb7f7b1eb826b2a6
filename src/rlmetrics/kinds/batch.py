"""A step's records of one kind, as the flat arrays a kind reduces in one pass.

The framework joins every call of every metric of a kind on one backend into a
``Batch``: host data with numpy, each device with torch (``DeviceBatch``). It holds the
values and weights in call order, metric by metric, and the metric (row) of each
element. A kind's ``reduce`` turns a batch into per-metric state rows with a fixed
number of array operations, however many calls and metrics there were. It does so
through the segment operations below, and the same code runs on numpy arrays and on
tensors of any device.

The framework's rules are applied before a kind sees the batch. An element whose weight
is 0 (deselected, in a rejected call, or non-finite under ``nonfinite="skip"``) has
weight 0 and value 0, so no NaN hides behind a zero weight.

The host fold hands kinds a subclass with fast paths of its own
(``rlmetrics._engine.host_batch``). It computes what this class computes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

Array = Any  # np.ndarray on the host, torch.Tensor on a device

COLUMNS = ("value", "negated_value", "weight", "weighted_value", "selected")
"""The per-element columns a kind can declare its slots with (``Batch.column``).

They are the value, its negation, the weight, value × weight, and 1 where selected
(weight > 0). A SUM slot sums its column over a metric's elements; one that is not
selected has value and weight 0 by then, so it adds nothing. A MAX slot takes its
column's max over the selected elements (-inf when there is none)."""


class Batch:
    """One backend's records of one kind (see the module docstring).

    Attributes:
        values: float64, 1-D, every element in call order, metric by metric.
        weights: float64, 1-D, the elements' weights (> 0: selected).
        segments: int64, 1-D, the row (metric) of each element, ascending. Made from
            ``lengths`` when first read, if the batch was made without.
        lengths: int64 host array, the number of elements of each row.
        call_lengths: int64 host array, the number of elements of each log call, in
            order.
        num_rows: how many metrics the batch holds.
        all_selected: every weight is > 0 (the fold's batches of python numbers).
        one_per_row: one element per row (``last_elements``).

    A batch and its arrays are valid while the fold that made it runs. A host fold
    writes its large arrays into buffers the next fold writes over. So what a kind keeps
    beyond its reduce (its extras) must be new: ``split`` hands out pieces it may keep,
    and the reductions are new arrays. A view of ``values``, ``weights`` or
    ``selected()`` is not.
    """

    on_host: bool = True
    xp: Any = np  # the array namespace: numpy here, torch on a device
    all_selected: bool = False
    one_per_row: bool = False
    values: Array

    def __init__(
        self,
        values: Array,
        weights: Array,
        segments: Array | None,
        lengths: Sequence[int] | np.ndarray,
        call_lengths: Sequence[int] | np.ndarray,
    ) -> None:
        self.values = values
        self._weights = weights
        self._segments = segments
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.call_lengths = np.asarray(call_lengths, dtype=np.int64)
        self.num_rows = len(self.lengths)
        self._selected: Array | None = None
        self._count: Array | None = None

    @property
    def weights(self) -> Array:
        return self._weights

    @weights.setter
    def weights(self, weights: Array) -> None:
        self._weights, self._selected, self._count = weights, None, None

    @property
    def segments(self) -> Array:
        if self._segments is None:
            self._segments = self.constant(np.repeat(np.arange(self.num_rows), self.lengths))
        return self._segments

    def part(self, rows: slice, elements: slice, calls: slice) -> Batch:
        """The batch of ``rows``, numbered from 0, whose elements and calls are
        ``elements`` and ``calls``: how the fold hands each kind its own metrics."""
        segments = self._segments
        if segments is not None:
            segments = segments[elements]
            segments = segments - rows.start if rows.start else segments
        part = type(self)(
            self.values[elements],
            self.weights[elements],
            segments,
            self.lengths[rows],
            self.call_lengths[calls],
        )
        if self.all_selected:
            part.all_selected = True
        else:
            part._selected = self.selected()[elements]
        return part

    def row_starts(self) -> np.ndarray:
        """Per row, the position of its first element (host array)."""
        return np.cumsum(self.lengths) - self.lengths

    def rows_full(self) -> bool:
        """Whether every row has an element."""
        return bool(self.lengths.all())

    # -- operations a kind's reduce uses ---------------------------------------------
    def selected(self) -> Array:
        """Bool per element: weight > 0."""
        if self._selected is None:
            self._selected = self.weights > 0
        return self._selected

    def count(self) -> Array:
        """Per row, the number of selected elements (float64; kept once counted)."""
        if self._count is None:
            if self.all_selected:
                self._count = self.constant(self.lengths.astype(np.float64))
            else:
                self._count = self.sum_by(self.selected())
        return self._count

    def column(self, name: str) -> Array:
        """A per-element column by its name in ``COLUMNS``.

        The columns are what a kind's declared slots are made of (``Kind.sum_columns``).
        """
        if name == "value":
            return self.values
        if name == "negated_value":
            return -self.values
        if name == "weight":
            return self.weights
        if name == "weighted_value":
            return self.values * self.weights
        if name == "selected":
            return self.as_float(self.selected())
        raise ValueError(f"unknown column {name!r}; columns: {', '.join(COLUMNS)}")

    def column_sum(self, name: str) -> Array:
        """Per row, the sum of the column ``name`` over the row's elements."""
        if name == "selected":
            return self.count()
        if self.one_per_row:
            return self.column(name)  # as it is: a sum would turn -0.0 into 0.0
        return self.sum_by(self.column(name))

    def column_max(self, name: str) -> Array:
        """Per row, the max of the column ``name`` over the row's selected elements.

        A row without one gets -inf; NaN wins."""
        column = self.select(self.column(name), -math.inf)
        return column if self.one_per_row else self.max_by(column)

    def column_sums(self, names: Sequence[str]) -> Array:
        """``column_sum`` of each of ``names``, laid end to end (num_rows values each)."""
        return self._end_to_end([self.column_sum(name) for name in names])

    def column_maxes(self, names: Sequence[str]) -> Array:
        """``column_max`` of each of ``names``, laid end to end."""
        return self._end_to_end([self.column_max(name) for name in names])

    def _end_to_end(self, per_row: list[Array]) -> Array:
        """Per-row arrays laid end to end (an empty float64 array for none)."""
        if len(per_row) == 1:
            return per_row[0]
        return self.xp.concatenate(per_row) if per_row else self.constant(np.zeros(0))

    def select(self, x: Array, fill: float) -> Array:
        """``x`` where an element is selected, ``fill`` elsewhere."""
        return x if self.all_selected else self.where(self.selected(), x, fill)

    def sum_by(self, x: Array, keys: Array | None = None, size: int | None = None) -> Array:
        """Per row, the sum of ``x`` over the row's elements (0 for an empty row).

        With ``keys``, the sums of ``x`` by key in ``range(size)`` instead."""
        if keys is None:
            keys, size = self.segments, self.num_rows
        elif size is None:
            raise TypeError("sum_by: keys take a size")
        return np.bincount(keys, weights=x, minlength=size)[:size]

    def max_by(self, x: Array) -> Array:
        """Per row, the max of ``x`` (NaN wins; -inf for an empty row)."""
        out = np.full(self.num_rows, -math.inf)
        np.maximum.at(out, self.segments, x)
        return out

    def zero_unselected(self) -> None:
        """Give the elements that are not selected the value 0.

        No arithmetic on them then reaches a sum (``NaN * 0`` is NaN)."""
        if not self.all_selected:
            self.values = self.where(self.selected(), self.values, 0.0)

    def last_elements(self) -> Batch:
        """A batch of each row's last selected element: what a replacing kind reduces.

        It holds one element per row; a row without a selected element gets an
        unselected zero."""
        full = self.all_selected and self.rows_full()
        if full:  # every row's last element
            index = self._last_index()
            values, weights = self.values[index], self.weights[index]
        else:
            last = self.max_by(self.select(self.positions(), -1.0))
            present = last >= 0
            values = self.where(present, self.take(self.values, last), 0.0)
            weights = self.where(present, self.take(self.weights, last), 0.0)
        out = self._one_each(values, weights)
        out.all_selected = full
        out.one_per_row = True
        return out

    def _last_index(self) -> np.ndarray:
        """Per row (all full), the position of its last element."""
        return self.row_starts() + (self.lengths - 1)

    def _one_each(self, values: Array, weights: Array) -> Batch:
        """A batch of one element per row."""
        ones = np.ones(self.num_rows, dtype=np.int64)
        return type(self)(values, weights, self.constant(np.arange(self.num_rows)), ones, ones)

    def chunk_index(self, parts: int) -> Array:
        """Per element, which of ``parts`` equal chunks of its call it falls in.

        Calls hold a multiple of ``parts`` elements (see ``Kind.parts``)."""
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
        """``x`` cut into its rows' pieces, which a kind may keep (its extras).

        On the host they are views of a copy of ``x``: ``x`` may be (a view of) a buffer
        the next fold writes over."""
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

    def zero_unselected(self) -> None:
        if not self.all_selected:  # no check for non-finite values: it would wait for them
            self.values = torch.where(self.selected(), self.values, 0.0)

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
    """A host array on ``device`` without waiting for the device.

    A CUDA copy goes through pinned memory, asynchronously: a pageable copy would wait
    for the stream."""
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
