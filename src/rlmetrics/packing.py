"""Packing many metrics' states into a few flat buffers (the host never waits on the
device here), and back: unpacking checks the rejected-call counts, merges the gathered
extras in rank order and returns a ``Reduced`` step."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import reduce
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlmetrics.kinds.base import NUM_COUNTS, Accumulator
from rlmetrics.kinds.batch import to_device
from rlmetrics.layout import Layout
from rlmetrics.results import Reduced, nonfinite_counts
from rlmetrics.table import Table


class RejectedInputError(ValueError):
    """Tensor log calls were rejected on the device (negative or non-finite weights, or
    non-finite values under ``nonfinite="error"``) and dropped; raised at step end."""


@dataclass(eq=False)
class Packing:
    """Where a table's slots go in one layout's buffer ``[SUM | MAX | end]`` (the end:
    ``agreed.Plan.max_end``), for the metrics logged in a step (``make``'s ``accs``: per
    placement, its accumulator or None).

    Built once per set of metrics (the sync code caches it with its plan): packing a
    step is then a copy of ``template`` and one indexed assignment per array, plus one
    indexed add per array for a device half. Slots of rows outside ``accs`` (names not
    logged this step, always empty) go to a scratch slot past the end. The host buffer
    (``host``, and ``tensor`` over it) is reused: each step packs into it, and what is
    read from it is read before the next step packs.
    """

    layout: Layout
    template: np.ndarray  # empty SUM and MAX parts, the end, one scratch slot
    sum_map: np.ndarray  # per table SUM slot, its position
    count_map: np.ndarray  # per table count (rows x NUM_COUNTS, row-major)
    max_map: np.ndarray  # per table MAX slot
    extra_rows: list[tuple[int, Accumulator | None]]  # (size slot, accumulator)
    version: int  # the table's row version the maps were built for
    device_maps: dict[Any, tuple[Tensor, Tensor, Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.host = self.template.copy()
        self.tensor = torch.from_numpy(self.host[:-1])  # without the scratch slot

    @classmethod
    def make(
        cls, layout: Layout, accs: list[Accumulator | None], table: Table, end: np.ndarray
    ) -> Packing:
        length = layout.num_sums + layout.num_maxes + len(end)
        template = np.zeros(length + 1)
        template[layout.num_sums : layout.num_sums + layout.num_maxes] = -math.inf
        template[length - len(end) : length] = end
        sum_map = np.full(table.num_sums, length, dtype=np.int64)
        max_map = np.full(table.num_maxes, length, dtype=np.int64)
        count_map = np.full(table.num_rows * NUM_COUNTS, length, dtype=np.int64)
        extra_rows = []
        for place, acc in zip(layout.placements, accs, strict=True):
            num_maxes = place.kind.num_maxes
            if place.kind.has_extra:
                extra_rows.append((layout.num_sums + place.max_offset + num_maxes, acc))
            if acc is None:
                continue
            row = acc.row
            start, num_sums = table.sum_at[row], place.kind.num_sums
            sum_map[start : start + num_sums] = np.arange(num_sums) + place.sum_offset
            start = table.max_at[row]
            max_map[start : start + num_maxes] = (
                np.arange(num_maxes) + layout.num_sums + place.max_offset
            )
            count_map[row * NUM_COUNTS : (row + 1) * NUM_COUNTS] = np.arange(
                place.count_offset, place.count_offset + NUM_COUNTS
            )
        return cls(layout, template, sum_map, count_map, max_map, extra_rows, table.version)

    def pack(self, table: Table, device: torch.device) -> Tensor:
        """This process's ``[SUM | MAX | end]`` buffer on ``device``: host half copied,
        device half added there (no host sync)."""
        host = self.pack_host(table)
        part = table.device_part
        if part is None:
            return self.tensor if device.type == "cpu" else self.tensor.to(device)
        buffer = to_device(host, part.device)
        sums, counts, maxes = self._device_maps(part.device)
        buffer.index_add_(0, sums, part.sums[: len(sums)])
        buffer.index_add_(0, counts, part.counts[: len(counts) // NUM_COUNTS].reshape(-1))
        buffer[maxes] = torch.maximum(buffer[maxes], part.maxes[: len(maxes)])
        return buffer[:-1].to(device)

    def pack_host(self, table: Table) -> np.ndarray:
        """The host half's buffer (``host``), with the scratch slot at the end."""
        host = self.host
        host[:] = self.template
        host[self.sum_map] = table.sums[: len(self.sum_map)]
        rows = len(self.count_map) // NUM_COUNTS  # rows added since are not logged here
        host[self.count_map] = table.counts[:rows].reshape(-1)
        host[self.max_map] = table.maxes[: len(self.max_map)]
        for position, acc in self.extra_rows:
            if acc is not None:
                part = table.device_part
                dev_extra = None if part is None else part.extras.get(acc.row)
                host[position] = acc.kind.extra_size(table.extras[acc.row], dev_extra)
        return host

    def _device_maps(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        maps = self.device_maps.get(device)
        if maps is None:
            maps = self.device_maps[device] = tuple(
                to_device(m, device) for m in (self.sum_map, self.count_map, self.max_map)
            )
        return maps


def with_nan_counts(packed: Tensor, layout: Layout) -> Tensor:
    """A ``[SUM | MAX | end]`` buffer as ``[SUM | NaN counts | MAX | end]`` for
    ``all_reduce(MAX)``, which need not propagate NaN (gloo does not): each NaN max slot
    is carried as +inf and counted in the additive part (see ``restore_nans``)."""
    num_sums, num_maxes = layout.num_sums, layout.num_maxes
    maxes = packed[num_sums : num_sums + num_maxes]
    is_nan = torch.isnan(maxes)
    maxes = torch.where(is_nan, math.inf, maxes)
    parts = (packed[:num_sums], is_nan.double(), maxes, packed[num_sums + num_maxes :])
    return torch.cat(parts)


def in_order(accumulators: Mapping[str, Accumulator], layout: Layout) -> list[Accumulator | None]:
    """The accumulators in layout order, None where this process logged nothing.

    Raises:
        KeyError: an accumulator's name is not in the layout.
    """
    accs = list(map(accumulators.get, layout.names))
    if len(accs) - accs.count(None) != len(accumulators):
        unknown = next(name for name in accumulators if name not in layout.index)
        raise KeyError(unknown)
    return accs


def restore_nans(sums: np.ndarray, maxes: np.ndarray, layout: Layout) -> np.ndarray:
    """The MAX part (its end included) of an all-reduced buffer packed by
    ``with_nan_counts``, with NaN back where any rank had one; ``sums`` is the whole
    additive part."""
    counts = sums[layout.num_sums :]
    if not np.count_nonzero(counts):
        return maxes
    maxes = maxes.copy()
    maxes[: layout.num_maxes][counts > 0] = math.nan
    return maxes


def extra_sizes(layout: Layout, maxes: np.ndarray) -> list[int]:
    """The padded extra size of each extra placement, read from a (reduced) MAX buffer."""
    sizes = [maxes[place.max_offset + place.kind.num_maxes] for place in layout.extra_placements]
    return [int(size) if size > 0 else 0 for size in sizes]  # -inf: no rank logged it


def pack_extras(
    packing: Packing, table: Table, sizes: Sequence[int], device: torch.device
) -> tuple[Tensor, dict[str, object]]:
    """This process's gather buffer (packable extras, padded to ``sizes``) and the host
    extras of kinds that cannot be packed (these travel by object gather)."""
    vectors: list[Tensor] = []
    objects: dict[str, object] = {}
    part = table.device_part
    layout = packing.layout
    extra_accs = [acc for (_, acc) in packing.extra_rows]
    for place, acc, size in zip(layout.extra_placements, extra_accs, sizes, strict=True):
        kind = place.kind
        extra, dev_extra = kind.empty_extra(), None
        if acc is not None:
            extra = table.extras[acc.row]
            dev_extra = None if part is None else part.extras.get(acc.row)
        vector = kind.extra_vector(extra, dev_extra, device, size)
        if vector is None:
            objects[place.name] = (
                kind.empty_extra() if acc is None else table.whole_extra(acc.row, kind)
            )
        else:
            vectors.append(vector)
    if not vectors:
        return torch.zeros(0, dtype=torch.float64, device=device), objects
    return torch.cat(vectors), objects


def unpack(
    layout: Layout,
    sums: np.ndarray,
    maxes: np.ndarray,
    extras: Sequence[np.ndarray],
    objects: Sequence[Mapping[str, object]],
    sizes: Sequence[int],
    logged: np.ndarray | None = None,
) -> Reduced:
    """Reduced buffers (and gathered extras) as a ``Reduced`` step.

    ``sums`` is the SUM part, ``maxes`` the MAX part (NaN as merged). ``extras`` holds
    one gather buffer per rank (rank order) and ``objects`` one dict of object extras per
    rank; each rank's extras are merged in rank order.

    Raises:
        RejectedInputError: a metric received rejected input (negative weights, or
            non-finite values under ``nonfinite="error"``) in a tensor log call.
    """
    counts, nonfinite = sums[layout.num_kind_sums :], None
    if np.count_nonzero(counts):
        rejected = counts[1::NUM_COUNTS]
        if rejected.any():
            _raise_rejected(layout, rejected)
        nonfinite = nonfinite_counts(layout, sums)
    extra_values = _split_extras(layout, extras, objects, sizes) if layout.extra_placements else {}
    keep = None if logged is None or logged.all() else logged > 0
    return Reduced(layout, sums, maxes[: layout.num_maxes], extra_values, keep, nonfinite)


def _raise_rejected(layout: Layout, counts: np.ndarray) -> None:
    rejected = [
        f"{place.name!r} ({place.kind.name}): {int(n)}"
        for place, n in zip(layout.placements, counts, strict=True)
        if n > 0
    ]
    raise RejectedInputError(
        "tensor log calls were rejected (negative or non-finite weights, or non-finite "
        "values under nonfinite='error') and dropped; rejected calls per metric: "
        + ", ".join(rejected)
    )


def _split_extras(
    layout: Layout,
    extras: Sequence[np.ndarray],
    objects: Sequence[Mapping[str, object]],
    sizes: Sequence[int],
) -> dict[str, object]:
    """Each extra placement's extras merged in rank order. A piece read from a gather buffer
    is a new object, so the first rank's starts the merge; object extras (which may be
    a rank's own) merge into an empty extra."""
    merged: dict[str, object] = {}
    offset = 0  # every rank's buffer has the same layout (the group's padded sizes)
    for place, size in zip(layout.extra_placements, sizes, strict=True):
        kind = place.kind
        if place.name in (objects[0] if objects else {}):
            pieces = [rank_objects[place.name] for rank_objects in objects]
            merged[place.name] = reduce(kind.merge_extra, pieces, kind.empty_extra())
            continue
        length = kind.vector_length(size)
        pieces = [kind.extra_from_vector(buffer[offset : offset + length]) for buffer in extras]
        offset += length
        merged[place.name] = reduce(kind.merge_extra, pieces) if pieces else kind.empty_extra()
    return merged


def local_reduce(packing: Packing, table: Table) -> Reduced:
    """This process's step, with one device-to-host transfer per buffer."""
    layout, part = packing.layout, table.device_part
    if part is None:
        host, device = packing.pack_host(table)[:-1], torch.device("cpu")
    else:
        device = part.device
        host = packing.pack(table, device).cpu().numpy()
    sums, maxes = host[: layout.num_sums], host[layout.num_sums :]
    if not layout.extra_placements:
        return unpack(layout, sums, maxes, [], [], [])
    sizes = extra_sizes(layout, maxes)
    extras, objects = pack_extras(packing, table, sizes, device)
    return unpack(layout, sums, maxes, [extras.cpu().numpy()], [objects], sizes)
