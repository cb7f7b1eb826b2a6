"""A tracker's folded state: one row per metric, every row in a few flat arrays.

The fold (``rlmetrics._engine.fold``) reduces a step's records into rows here, a whole
kind at a time: one indexed add per array, however many metrics. Packing copies the
arrays into the collective's buffer with one indexed assignment each. Nothing here loops
over metrics in python, except for kinds with an extra payload.

A row's state lives in two halves that meet only when packed. The host half (numpy)
holds what host data folds into. The device half holds tensors on the first device a
tensor record folded on, without a host sync. Sums add across the halves; maxes take the
max.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlmetrics.kinds.base import NUM_COUNTS, Kind, MetricState, carries_extra
from rlmetrics.kinds.batch import to_device
from rlmetrics.kinds.extra import ExtraKind

UNMERGED: Any = object()
"""``StateTable.load``'s default extra: not merged by the caller."""

Positions = tuple[np.ndarray, np.ndarray, np.ndarray]  # rows, SUM and MAX positions
IndexOn = Callable[[np.ndarray, torch.device], Tensor]  # an index array's device copy


@dataclass(eq=False)
class DevicePart:
    """The device half of a table: the same slots as the host arrays (zero / -inf
    where nothing folded on the device) and each row's device extras."""

    sums: Tensor
    maxes: Tensor
    counts: Tensor  # (rows, NUM_COUNTS)
    extras: dict[int, Any] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.sums.device


class StateTable:
    """Rows of folded state: additive slots (``sums``), max slots (``maxes``), the
    framework counts (``counts``: non-finite elements skipped, calls rejected) and, for
    kinds with one, an extra payload per row (``extras``).

    Rows are added as names appear and kept across steps; ``clear`` empties every row
    at a step's start.
    """

    def __init__(self) -> None:
        self.sum_at: list[int] = []  # per row, its first SUM slot
        self.max_at: list[int] = []
        self.widths: list[tuple[int, int]] = []  # per row, (num_sums, num_maxes)
        self.num_sums = self.num_maxes = 0
        self.sums = np.zeros(16)
        self.maxes = np.full(16, -math.inf)
        self.counts = np.zeros((16, NUM_COUNTS))
        self.extras: dict[int, Any] = {}  # row -> host extra (extra kinds only)
        self.extra_kinds: dict[int, ExtraKind] = {}
        self.device_part: DevicePart | None = None
        self.version = 0  # changes when rows are renumbered (``compacted``)
        self.value_rejections = False
        """Whether the first count is the calls rejected for a non-finite value (the
        tracker's ``nonfinite="error"``, where no element is skipped) rather than the
        non-finite elements skipped."""
        self._starts: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def num_rows(self) -> int:
        return len(self.sum_at)

    def add_row(self, kind: Kind) -> int:
        """A new empty row for a metric of ``kind``; returns its index."""
        row = self.num_rows
        self.sum_at.append(self.num_sums)
        self.max_at.append(self.num_maxes)
        self.widths.append((kind.num_sums, kind.num_maxes))
        self.num_sums += kind.num_sums
        self.num_maxes += kind.num_maxes
        self._starts = None
        if self.num_sums > len(self.sums) or self.num_maxes > len(self.maxes):
            self.sums = _grown(self.sums, self.num_sums, 0.0)
            self.maxes = _grown(self.maxes, self.num_maxes, -math.inf)
        if row >= len(self.counts):
            self.counts = np.concatenate((self.counts, np.zeros_like(self.counts)))
        if self.device_part is not None:  # the device half keeps the host's capacity
            self.device_for(self.device_part.device)
        if carries_extra(kind):
            self.extras[row] = kind.empty_extra()
            self.extra_kinds[row] = kind
        return row

    def clear(self) -> None:
        """Empty every row."""
        self.sums.fill(0.0)
        if self.num_maxes:  # else no slot was written since the array was made
            self.maxes.fill(-math.inf)
        self.counts.fill(0.0)
        extra_kinds = self.extra_kinds
        self.extras = (
            {row: kind.empty_extra() for row, kind in extra_kinds.items()} if extra_kinds else {}
        )
        self.device_part = None

    def compacted(self, metrics: list[Any]) -> StateTable:
        """A new empty table with a row for each of ``metrics`` only, which it renumbers
        (names that came and went drop out)."""
        table = StateTable()
        table.version = self.version + 1
        for records in metrics:
            records.row = table.add_row(records.kind)
            records.table = table
        return table

    def clear_row(self, row: int, kind: Kind) -> None:
        """Empty one row (a metric dropped mid-step)."""
        (s, m), sum_at, max_at = self.widths[row], self.sum_at[row], self.max_at[row]
        self.sums[sum_at : sum_at + s] = 0.0
        self.maxes[max_at : max_at + m] = -math.inf
        self.counts[row] = 0.0
        if carries_extra(kind):
            self.extras[row] = kind.empty_extra()
        part = self.device_part
        if part is not None:
            part.sums[sum_at : sum_at + s] = 0.0
            part.maxes[max_at : max_at + m] = -math.inf
            part.counts[row] = 0.0
            part.extras.pop(row, None)

    # -- positions ------------------------------------------------------------------
    def starts(self) -> tuple[np.ndarray, np.ndarray]:
        """Per row, its first SUM and MAX slot, as arrays (rebuilt when rows change)."""
        if self._starts is None:
            self._starts = (np.array(self.sum_at, np.int64), np.array(self.max_at, np.int64))
        return self._starts

    def positions(self, rows: np.ndarray, kind: Kind) -> tuple[np.ndarray, np.ndarray]:
        """The (len(rows), num_sums) SUM and (len(rows), num_maxes) MAX positions of
        ``rows``, all of ``kind`` (with the rows: ``Positions``)."""
        sum_starts, max_starts = self.starts()
        sums = sum_starts[rows][:, None] + np.arange(kind.num_sums)
        maxes = max_starts[rows][:, None] + np.arange(kind.num_maxes)
        return sums, maxes

    # -- folding --------------------------------------------------------------------
    def add(
        self, sum_positions: np.ndarray, sums: np.ndarray, max_positions: np.ndarray, maxes: Any
    ) -> None:
        """Fold host rows in: ``sums`` add at ``sum_positions`` and ``maxes`` take the
        max at ``max_positions`` (flat, each position once; none for kinds of sums
        alone, such as mean's)."""
        self.sums[sum_positions] += sums
        if len(max_positions):
            self.maxes[max_positions] = np.maximum(self.maxes[max_positions], maxes)

    def replace(
        self,
        positions: Positions,
        sums: np.ndarray,
        maxes: np.ndarray,
        present: Any,
        index_on: IndexOn,
    ) -> None:
        """Fold host rows of a replacing kind in (``positions`` as ``positions`` gives
        them): the rows ``present`` (with a new value; None: all) replace their old
        value, on both halves (``index_on`` puts positions on the device half's device)."""
        _, sum_pos, max_pos = positions
        if present is not None:
            sum_pos, max_pos, sums, maxes = (a[present] for a in (sum_pos, max_pos, sums, maxes))
        self.sums[sum_pos] = sums
        self.maxes[max_pos] = maxes
        part = self.device_part
        if part is not None and sum_pos.size:
            part.sums[index_on(sum_pos, part.device)] = 0.0
            part.maxes[index_on(max_pos, part.device)] = -math.inf

    def add_device(
        self,
        sum_positions: np.ndarray,
        sums: Tensor,
        max_positions: np.ndarray,
        maxes: Tensor,
        index_on: IndexOn,
    ) -> None:
        """Fold device rows in as ``add`` does, without a host sync (``index_on``
        gives the positions' device copies, made once per array)."""
        part = self.device_for(sums.device)
        sums, maxes = sums.to(part.device), maxes.to(part.device)
        max_index = index_on(max_positions, part.device)
        part.sums.index_add_(0, index_on(sum_positions, part.device), sums)
        part.maxes[max_index] = torch.maximum(part.maxes[max_index], maxes)

    def replace_device(
        self,
        positions: Positions,
        sums: Tensor,
        maxes: Tensor,
        present: Tensor,
        index_on: IndexOn,
    ) -> None:
        """Fold device rows of a replacing kind in (no host sync): the rows ``present``
        (a device bool per row) replace the old value, which spans both halves: the host
        half moves to the device first."""
        part = self.device_for(sums.device)
        sums, maxes = sums.to(part.device), maxes.to(part.device)
        _, sum_pos, max_pos = positions
        sum_index = index_on(sum_pos, part.device)
        max_index = index_on(max_pos, part.device)
        old_sums = part.sums[sum_index] + to_device(self.sums[sum_pos], part.device)
        old_maxes = torch.maximum(
            part.maxes[max_index], to_device(self.maxes[max_pos], part.device)
        )
        keep = present.to(part.device)[:, None]
        part.sums[sum_index] = torch.where(keep, sums, old_sums)
        part.maxes[max_index] = torch.where(keep, maxes, old_maxes)
        self.sums[sum_pos] = 0.0
        self.maxes[max_pos] = -math.inf

    def add_counts(self, rows: np.ndarray, counts: Any) -> None:
        """Add framework counts ([skipped, rejected] per row; host array or tensor)."""
        if isinstance(counts, Tensor):
            part = self.device_for(counts.device)
            part.counts.index_add_(0, to_device(rows, part.device), counts.to(part.device))
        else:
            self.counts[rows] += counts

    def count(self, row: int, slot: int, amount: float = 1.0) -> None:
        """Add to one host framework count."""
        self.counts[row, slot] += amount

    def device_for(self, device: torch.device) -> DevicePart:
        """The device half (made on ``device`` when there is none), grown to every row."""
        part = self.device_part
        if part is None:
            part = self.device_part = DevicePart(
                torch.zeros(len(self.sums), dtype=torch.float64, device=device),
                torch.full((len(self.maxes),), -math.inf, dtype=torch.float64, device=device),
                torch.zeros(self.counts.shape, dtype=torch.float64, device=device),
            )
        elif len(part.sums) < len(self.sums) or len(part.counts) < len(self.counts):
            part.sums = _grown_tensor(part.sums, len(self.sums), 0.0)
            part.maxes = _grown_tensor(part.maxes, len(self.maxes), -math.inf)
            part.counts = _grown_tensor(part.counts, len(self.counts), 0.0)
        return part

    # -- one row --------------------------------------------------------------------
    def rejected(self, row: int) -> float:
        """Row ``row``'s rejected-call count (reads the device half: may sync)."""
        count = float(self.counts[row, -1])
        part = self.device_part
        if part is not None:
            count += float(part.counts[row, -1])
        return count

    def forget_rejected(self) -> None:
        """Zero every rejected-call count (once reported), and the counts of calls
        rejected for a non-finite value where the first count holds them."""
        counts = slice(None) if self.value_rejections else -1
        self.counts[:, counts] = 0.0
        if self.device_part is not None:
            self.device_part.counts[:, counts] = 0.0

    def whole_extra(self, row: int, kind: ExtraKind) -> Any:
        """Row ``row``'s extra on the host, both halves merged (may sync)."""
        part = self.device_part
        dev_extra = None if part is None else part.extras.get(row)
        if dev_extra is None:
            return self.extras[row]
        return kind.merge_extra(self.extras[row], kind.host_extra(dev_extra))

    def load(self, row: int, state: MetricState, kind: Kind, extra: Any = UNMERGED) -> None:
        """Merge a host snapshot into row ``row``; ``extra``: the merged extra, when the
        caller merged the row's and the snapshot's already (``Tracker.merge`` does, so
        that a merge that raises changes nothing)."""
        (s, m), sum_at, max_at = self.widths[row], self.sum_at[row], self.max_at[row]
        self.sums[sum_at : sum_at + s] += state.sums
        self.maxes[max_at : max_at + m] = np.maximum(self.maxes[max_at : max_at + m], state.maxes)
        self.counts[row, 0] += state.num_nonfinite
        if carries_extra(kind):
            if extra is UNMERGED:
                extra = kind.merge_extra(self.extras[row], state.extra)
            self.extras[row] = extra

    def is_empty(self, row: int, kind: Kind) -> bool:
        """Whether the host half of row ``row`` holds nothing."""
        (s, m), sum_at, max_at = self.widths[row], self.sum_at[row], self.max_at[row]
        if self.sums[sum_at : sum_at + s].any():
            return False
        if (self.maxes[max_at : max_at + m] != -math.inf).any():
            return False
        if not carries_extra(kind):
            return True
        try:
            return bool(self.extras[row] == kind.empty_extra())
        except (TypeError, ValueError):  # an extra whose == is elementwise: not empty
            return False


def _grown(array: np.ndarray, size: int, fill: float) -> np.ndarray:
    out = np.full(max(size, 2 * len(array)), fill)
    out[: len(array)] = array
    return out


def _grown_tensor(tensor: Tensor, size: int, fill: float) -> Tensor:
    extra = torch.full((size - len(tensor), *tensor.shape[1:]), fill, dtype=tensor.dtype)
    return torch.cat((tensor, extra.to(tensor.device)))
