"""Where a batch's elements belong (``BatchRows``), and what follows from it, derived once.

A fold keeps the rows of its python numbers across steps (``rlmetrics._engine.fold_plan``),
so everything here that follows from them (row starts, counts, each kind's part) is
computed on a steady-state step's first fold only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

Array = Any  # np.ndarray on the host, torch.Tensor on a device

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
            backend).
        lengths: int64 host array, the number of elements of each row.
        call_lengths: int64 host array, the number of elements of each log call.
        num_rows: how many rows.
        keyed: whether the host sums of these rows go by key (a small batch) rather
            than by segment; the parts of a batch keep its choice, so that every sum
            of one fold adds its elements alike (the same bits, whichever kind's code
            or part sums them).
    """

    __slots__ = (
        "_full", "_memo", "_starts", "call_lengths", "keyed", "lengths", "num_rows", "segments"
    )  # fmt: skip

    def __init__(
        self,
        segments: Array,
        lengths: Sequence[int] | np.ndarray,
        call_lengths: Sequence[int] | np.ndarray,
        starts: np.ndarray | None = None,
        full: bool | None = None,
        keyed: bool | None = None,
    ) -> None:
        self.segments = segments
        self.keyed = len(segments) <= SMALL if keyed is None else keyed
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.call_lengths = np.asarray(call_lengths, dtype=np.int64)
        self.num_rows = len(self.lengths)
        self._starts = starts
        self._full = full
        self._memo: dict[Any, Any] = {}  # what follows from the rows, by what it is

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
            segments = self.segments[elements]
            starts = self._starts
            if starts is not None:
                starts = starts[rows] - elements.start if elements.start else starts[rows]
            part = self._memo[key] = BatchRows(
                segments - rows.start if rows.start else segments,
                self.lengths[rows],
                self.call_lengths[calls],
                starts,
                True if self._full else None,  # a part of a full batch is full
                self.keyed,
            )
        return part
