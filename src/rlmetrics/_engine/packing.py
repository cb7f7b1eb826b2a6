"""The pack stage: many metrics' states in a few flat buffers (the host never waits on
the device here), and back. Unpacking checks the rejected-call counts, merges the
gathered extras in rank order and returns a ``ReducedStep``: one merged step in packed
form, whose ``results`` are the reported values.

Sync, the local path and ``TrackerState.compute`` all end in a ``ReducedStep``, so they
report the same bits. Each kind states its result once (``Kind.result_columns`` over its
block of the buffers); the values are reported sorted by metric name, a metric's
suffixed keys (``name/p50``) after it, empty metrics left out (or NaN), a non-finite
count where elements were skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import reduce
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor

from rlmetrics._engine.layout import BufferLayout
from rlmetrics._engine.record import MetricRecords
from rlmetrics._engine.table import StateTable
from rlmetrics.errors import RejectedInputError
from rlmetrics.kinds.base import NUM_COUNTS, Kind, MetricState
from rlmetrics.kinds.batch import to_device
from rlmetrics.kinds.extra import ExtraKind

CPU = torch.device("cpu")


@dataclass(eq=False)
class Packing:
    """Where a table's slots go in one layout's buffer ``[SUM | pad | MAX | end]``, for
    the metrics logged in a step (``make``'s ``metrics``: per placement, its MetricRecords or
    None). The SUM part is ``sum_part`` floats (padded to a group's size at sync); the
    end (the logged marks, padding and tail at sync, see ``rlmetrics._engine.sync``)
    follows the MAX slots.

    Built once per set of metrics (a tracker's ``StepPlan`` keeps it): packing a
    step is then one indexed assignment per array into ``host`` (made empty, with
    its end), plus one indexed add per array for a device half. Slots of rows outside
    ``metrics`` (names not logged this step, always empty) go to a scratch slot past the
    end. The host buffer (and ``tensor`` over it) is reused: each step packs into it,
    and what is read from it is read before the next step packs.
    """

    layout: BufferLayout
    sum_part: int  # the SUM part's length: the MAX part starts there
    host: np.ndarray  # the buffer: SUM part, MAX part, the end, one scratch slot
    sum_map: np.ndarray  # per table SUM slot, its position
    count_map: np.ndarray  # per table count (rows x NUM_COUNTS, row-major)
    max_map: np.ndarray  # per table MAX slot
    extra_rows: list[tuple[int, MetricRecords | None]]  # (size slot, its MetricRecords)
    device_maps: dict[Any, tuple[Tensor, ...]] = field(default_factory=dict)
    sizes: Any = None  # the group's padded sizes it was made for (sync only)
    logged_all: bool = True  # this rank logged every name of the layout

    def __post_init__(self) -> None:
        self.tensor = torch.from_numpy(self.host[:-1])  # without the scratch slot
        # the SUM and MAX parts of ``host`` as views, which every local step reads
        self.host_sums = self.host[: self.sum_part]
        self.host_maxes = self.host[self.sum_part : -1]

    @classmethod
    def make(
        cls,
        layout: BufferLayout,
        metrics: list[MetricRecords | None],
        table: StateTable,
        sum_part: int | None = None,
        end: Sequence[float] | np.ndarray = (),
    ) -> Packing:
        """The packing of ``layout`` (``sum_part``: default, the layout's SUM slots)."""
        sum_part = layout.num_sums if sum_part is None else sum_part
        length = sum_part + layout.num_maxes + len(end)
        host = np.zeros(length + 1)
        host[sum_part : sum_part + layout.num_maxes] = -math.inf
        host[length - len(end) : length] = end
        sum_map = np.full(table.num_sums, length, dtype=np.int64)
        max_map = np.full(table.num_maxes, length, dtype=np.int64)
        count_map = np.full(table.num_rows * NUM_COUNTS, length, dtype=np.int64)
        extra_rows = []
        for place, records in zip(layout.placements, metrics, strict=True):
            num_maxes, max_at = place.kind.num_maxes, sum_part + place.max_offset
            if place.kind.has_extra:
                extra_rows.append((max_at + num_maxes, records))
            if records is None:
                continue
            row = records.row
            start, num_sums = table.sum_at[row], place.kind.num_sums
            sum_map[start : start + num_sums] = np.arange(num_sums) + place.sum_offset
            start = table.max_at[row]
            max_map[start : start + num_maxes] = np.arange(num_maxes) + max_at
            count_map[row * NUM_COUNTS : (row + 1) * NUM_COUNTS] = np.arange(
                place.count_offset, place.count_offset + NUM_COUNTS
            )
        maps = host, sum_map, count_map, max_map, extra_rows
        return cls(layout, sum_part, *maps)

    def pack(self, table: StateTable, device: torch.device) -> Tensor:
        """This process's ``[SUM part | MAX part]`` buffer on ``device``: host half
        copied, device half added there (no host sync)."""
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

    def pack_host(self, table: StateTable) -> np.ndarray:
        """The host half's buffer (``host``), with the scratch slot at the end. Each step
        writes the same positions (a CPU device half adds onto them), so the rest keeps
        the values ``make`` gave them."""
        host = self.host
        host[self.sum_map] = table.sums[: len(self.sum_map)]
        rows = len(self.count_map) // NUM_COUNTS  # rows added since are not logged here
        host[self.count_map] = table.counts[:rows].reshape(-1)
        if len(self.max_map):  # the table has max slots
            host[self.max_map] = table.maxes[: len(self.max_map)]
        for position, records in self.extra_rows:
            if records is not None:
                part = table.device_part
                dev_extra = None if part is None else part.extras.get(records.row)
                host[position] = cast(ExtraKind, records.kind).extra_size(
                    table.extras[records.row], dev_extra
                )
        return host

    def _device_maps(self, device: torch.device) -> tuple[Tensor, ...]:
        maps = self.device_maps.get(device)
        if maps is None:
            maps = self.device_maps[device] = tuple(
                to_device(m, device) for m in (self.sum_map, self.count_map, self.max_map)
            )
        return maps


def with_nan_counts(packed: Tensor, sum_part: int) -> Tensor:
    """A ``[SUM part | MAX part]`` buffer as ``[SUM part | NaN counts | MAX part]`` for
    ``all_reduce(SUM)`` of the first two and ``all_reduce(MAX)`` of the last, which
    need not propagate NaN (gloo does not): each NaN in the MAX part is carried as +inf
    and counted (see ``restore_nans``)."""
    maxes = packed[sum_part:]
    is_nan = torch.isnan(maxes)
    return torch.cat((packed[:sum_part], is_nan.double(), torch.where(is_nan, math.inf, maxes)))


def in_order(
    metric_records: Mapping[str, MetricRecords], layout: BufferLayout
) -> list[MetricRecords | None]:
    """The metric records in layout order (their names must be in it), None where this
    process logged nothing."""
    return list(map(metric_records.get, layout.names))


def restore_nans(counts: np.ndarray, maxes: np.ndarray) -> np.ndarray:
    """An all-reduced MAX part of a ``with_nan_counts`` buffer, with NaN back where any
    rank had one (``counts``: the reduced NaN counts)."""
    if not np.count_nonzero(counts):
        return maxes
    maxes = maxes.copy()
    maxes[counts > 0] = math.nan
    return maxes


def extra_sizes(layout: BufferLayout, maxes: np.ndarray) -> list[int]:
    """The padded extra size of each extra placement, read from a (reduced) MAX buffer."""
    sizes = [maxes[place.max_offset + place.kind.num_maxes] for place in layout.extra_placements]
    return [int(size) if size > 0 else 0 for size in sizes]  # -inf: no rank logged it


def pack_extras(
    packing: Packing, table: StateTable, sizes: Sequence[int], device: torch.device
) -> tuple[Tensor, dict[str, object]]:
    """This process's gather buffer (packable extras, padded to ``sizes``) and the host
    extras of kinds that cannot be packed (these travel by object gather)."""
    vectors: list[Tensor] = []
    objects: dict[str, object] = {}
    part = table.device_part
    layout = packing.layout
    extra_accs = [records for (_, records) in packing.extra_rows]
    for place, records, size in zip(layout.extra_placements, extra_accs, sizes, strict=True):
        kind = cast(ExtraKind, place.kind)  # an extra placement's
        extra, dev_extra = kind.empty_extra(), None
        if records is not None:
            extra = table.extras[records.row]
            dev_extra = None if part is None else part.extras.get(records.row)
        vector = kind.extra_vector(extra, dev_extra, device, size)
        if vector is None:
            objects[place.name] = (
                kind.empty_extra() if records is None else table.whole_extra(records.row, kind)
            )
        else:
            vectors.append(vector)
    if not vectors:
        return torch.zeros(0, dtype=torch.float64, device=device), objects
    return torch.cat(vectors), objects


GatherExtras = Callable[[Tensor, dict[str, object]], tuple[list[Any], list[Any]]]
"""All ranks' extras, in rank order: (gather buffers, dicts of object extras)."""


def unpack(
    packing: Packing,
    table: StateTable,
    sums: np.ndarray,
    maxes: np.ndarray,
    device: torch.device,
    logged: np.ndarray | None = None,
    gather: GatherExtras | None = None,
) -> ReducedStep:
    """The reduced SUM and MAX slots of ``packing``'s layout (NaN as merged) as a
    ``ReducedStep``, with the extras: this process's packed on ``device`` at the sizes
    the MAX slots hold, ``gather``ed over the group (without it, this process's own) and
    merged in rank order. ``logged``: per placement, whether any rank logged it (None:
    every one).

    Raises:
        RejectedInputError: a metric received rejected input (negative weights, or
            non-finite values under ``nonfinite="error"``) in a tensor log call.
    """
    layout = packing.layout
    counts, nonfinite = sums[layout.num_kind_sums :], None
    if np.count_nonzero(counts):
        rejected = counts[1::NUM_COUNTS]
        if rejected.any():
            by_value = counts[0::NUM_COUNTS] if table.value_rejections else None
            _raise_rejected(layout, rejected, by_value)
        nonfinite = nonfinite_counts(layout, sums)
    extras: dict[str, object] = {}
    if layout.extra_placements:
        sizes = extra_sizes(layout, maxes)
        vector, objects = pack_extras(packing, table, sizes, device)
        pieces: tuple[list[Any], list[Any]] = (
            gather(vector, objects) if gather else ([vector.cpu().numpy()], [objects])
        )
        extras = _split_extras(layout, *pieces, sizes)
    keep = None if logged is None or logged.all() else logged > 0
    return ReducedStep(layout, sums, maxes[: layout.num_maxes], extras, keep, nonfinite)


def _raise_rejected(
    layout: BufferLayout, rejected: np.ndarray, by_value: np.ndarray | None
) -> None:
    """Raise the step's ``RejectedInputError``: per metric, its rejected calls over every
    rank, and which rule they broke. ``by_value``: per placement, the calls rejected for
    a non-finite value under ``nonfinite="error"`` (None: the tracker's policy is
    another). The fold cannot tell the other rules apart: each zeroes the call's
    weights."""
    parts, footnote = [], ""
    for row, place in enumerate(layout.placements):
        calls = int(rejected[row])
        if calls <= 0:
            continue
        for_value = 0 if by_value is None else min(int(by_value[row]), calls)
        reasons = [
            f"{n} with {why}"
            for n, why in (
                (for_value, "a non-finite value"),
                (calls - for_value, "a negative or non-finite weight*"),
            )
            if n
        ]
        parts.append(f"{place.name!r} ({place.kind.name}): {calls} ({', '.join(reasons)})")
        if for_value < calls:
            footnote = (
                ". *or a negative or non-finite token count of throughput(), or a tensor "
                "changed in place after its log call on some rank"
            )
    raise RejectedInputError(
        "tensor log calls were rejected and dropped (the step's other calls are kept); "
        "rejected calls per metric, over every rank: " + "; ".join(parts) + footnote
    )


def _split_extras(
    layout: BufferLayout,
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
        kind = cast(ExtraKind, place.kind)  # an extra placement's
        if place.name in (objects[0] if objects else {}):
            pieces = [rank_objects[place.name] for rank_objects in objects]
            merged[place.name] = reduce(kind.merge_extra, pieces, kind.empty_extra())
            continue
        length = kind.vector_length(size)
        pieces = [kind.extra_from_vector(buffer[offset : offset + length]) for buffer in extras]
        offset += length
        merged[place.name] = reduce(kind.merge_extra, pieces) if pieces else kind.empty_extra()
    return merged


def local_reduce(packing: Packing, table: StateTable) -> ReducedStep:
    """This process's step, with one device-to-host transfer per buffer."""
    part, split = table.device_part, packing.sum_part
    if part is None:
        packing.pack_host(table)
        return unpack(packing, table, packing.host_sums, packing.host_maxes, CPU)
    host = packing.pack(table, part.device).cpu().numpy()
    return unpack(packing, table, host[:split], host[split:], part.device)


Suffixed = dict[int, tuple[Kind, dict[str, float]]]  # name position -> (kind, values)


@dataclass(slots=True, eq=False)  # not frozen: a frozen __init__ sets each field the slow way
class ReducedStep:
    """One merged step in packed form, read within the call that built it (``sums`` and
    ``maxes`` may be views of buffers the next step reuses).

    Attributes:
        layout: where each metric's slots are.
        sums: the SUM part (the kinds' sums, then two framework counts per metric).
        maxes: the MAX part (the kinds' max slots and the extra-size slots).
        extras: each extra kind's merged extra, by name.
        keep: per placement, whether any rank logged the name this step (None: every one).
        nonfinite: per placement, the non-finite elements skipped (None: none anywhere).
    """

    layout: BufferLayout
    sums: np.ndarray
    maxes: np.ndarray
    extras: Mapping[str, object]
    keep: np.ndarray | None
    nonfinite: np.ndarray | None

    @classmethod
    def from_states(
        cls, states: Mapping[str, MetricState], kind_of: Callable[[str], Kind]
    ) -> ReducedStep:
        """States laid out in buffers as a sync leaves them (``TrackerState.compute``).

        Raises:
            ValueError: a state's slot counts are not its kind's.
        """
        layout = BufferLayout([(name, kind_of(metric.kind)) for name, metric in states.items()])
        sums, maxes = np.zeros(layout.num_sums), np.full(layout.num_maxes, -math.inf)
        for place in layout.placements:
            metric, kind = states[place.name], place.kind
            sums[place.sum_offset : place.sum_offset + kind.num_sums] = metric.sums
            maxes[place.max_offset : place.max_offset + kind.num_maxes] = metric.maxes
            sums[place.count_offset] = metric.num_nonfinite
        extras = {place.name: states[place.name].extra for place in layout.extra_placements}
        return cls(layout, sums, maxes, extras, None, nonfinite_counts(layout, sums))

    def states(self) -> dict[str, MetricState]:
        """Per metric, its merged state, by name (names no rank logged are left out)."""
        layout, keep = self.layout, self.keep
        sums, maxes = self.sums.tolist(), self.maxes.tolist()
        prints = {id(kind): kind.fingerprint() for kind in layout.kinds}
        states = {}
        for i, place in enumerate(layout.placements):
            if keep is not None and not keep[i]:
                continue
            kind = place.kind
            states[place.name] = MetricState(
                kind.name,
                tuple(sums[place.sum_offset : place.sum_offset + kind.num_sums]),
                tuple(maxes[place.max_offset : place.max_offset + kind.num_maxes]),
                self.extras.get(place.name),
                float(sums[place.count_offset]),
                prints[id(kind)],
            )
        return states

    def results(self, *, empty: str) -> dict[str, float]:
        """Every metric's values, as ``compute()`` reports them.

        Raises:
            ValueError: two metrics report the same key (``x`` as dist reports ``x/mean``).
        """
        layout, sums, maxes = self.layout, self.sums, self.maxes
        if not layout.groups:
            return {}
        values: list[np.ndarray] = []
        shown: list[np.ndarray] = []
        suffixed: Suffixed = {}
        for group in layout.groups:  # each kind's block of the buffers, as views
            kind, names = group.kind, group.names
            block = maxes[group.maxes].reshape(group.max_shape)
            extras = None
            if kind.has_extra:
                block = block[:, : kind.num_maxes]  # without the extra size
                extras = [self.extras[name] for name in names]
            out, present = kind.result_columns(
                sums[group.sums].reshape(group.sum_shape), block, extras, names
            )
            shown.append(present)
            column = out.get("") if len(out) == 1 else None
            if column is not None:
                values.append(column)
                continue
            values.append(np.zeros(len(names)))  # reported from ``suffixed``
            columns = {suffix: column.tolist() for suffix, column in out.items()}
            for i, name in enumerate(names):
                suffixed[layout.index[name]] = (kind, {s: c[i] for s, c in columns.items()})
        if len(values) == 1:  # one group holds every name, in order
            value, present = values[0], shown[0]
        else:
            value = np.concatenate(values)[layout.by_name]
            present = np.concatenate(shown)[layout.by_name]
        plain = not suffixed and self.nonfinite is None and self.keep is None
        if plain and np.count_nonzero(present) == len(present):
            result = layout.keys.copy()
            result.update(zip(layout.names, value.tolist(), strict=True))
            return result
        return _laid_out(layout.names, value, present, suffixed, self.nonfinite, self.keep, empty)


def nonfinite_counts(layout: BufferLayout, sums: np.ndarray) -> np.ndarray | None:
    """Per placement, the non-finite elements skipped, read from a SUM part; None when none."""
    counts = sums[layout.num_kind_sums :: NUM_COUNTS]
    return counts if np.count_nonzero(counts) else None


def _laid_out(
    names: Sequence[str],
    values: np.ndarray,
    present: np.ndarray,
    suffixed: Suffixed,
    nonfinite: np.ndarray | None,
    keep: np.ndarray | None,
    empty: str,
) -> dict[str, float]:
    out: dict[str, float] = {}
    sources: dict[str, str] = {}
    shown = present.tolist()
    value_list = values.tolist()
    for row, name in enumerate(names):
        if keep is not None and not keep[row]:
            continue
        kind_values = suffixed.get(row)
        if shown[row]:
            metric = {"": value_list[row]} if kind_values is None else kind_values[1]
        elif empty == "nan":
            suffixes = ("",) if kind_values is None else kind_values[0].result_names()
            metric = dict.fromkeys(suffixes, math.nan)
        else:
            metric = {}
        if nonfinite is not None and nonfinite[row] > 0:
            metric = {**metric, "nonfinite_count": float(nonfinite[row])}
        for suffix, value in metric.items():
            key = f"{name}/{suffix}" if suffix else name
            if key in sources:
                raise ValueError(
                    f"metric {name!r} reports {key!r}, which metric {sources[key]!r} "
                    "reports too; rename one of them"
                )
            sources[key] = name
            out[key] = float(value)
    return out
