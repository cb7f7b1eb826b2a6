"""Packing many metrics' states into a few flat buffers, and back.

Packing copies host floats in one transfer and device tensors with one index_put per
buffer: the host never waits on the device here. Unpacking checks the rejected-call
counts, merges the gathered extras in rank order and returns a ``Reduced`` step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

import numpy as np
import torch
from torch import Tensor

from rlmetrics.kinds.base import NUM_FLAGS, Accumulator
from rlmetrics.layout import Layout
from rlmetrics.reduced import Reduced


class RejectedInputError(ValueError):
    """Tensor log calls were rejected on the device (negative or non-finite weights, or
    non-finite values under ``nonfinite="error"``) and dropped; raised at step end."""


def pack_scalars(
    accs: Sequence[Accumulator],
    layout: Layout,
    device: torch.device,
    *,
    max_tail: Sequence[float] | np.ndarray = (),
    nan_counts: bool = False,
    reuse: SendBuffer | None = None,
) -> Tensor:
    """This process's SUM and MAX buffers, one after the other in one float64 tensor on
    ``device``: [SUM | MAX | max_tail], or [SUM | NaN counts | MAX | max_tail].

    ``accs`` are the layout's accumulators in its order (``in_order``). The SUM part is
    merged by addition, the MAX part by max; ``max_tail`` is taken as is. A gather
    carries NaN as it is (the host max propagates it); ``all_reduce(MAX)`` need not
    (gloo does not, symmetrically), so for it ``nan_counts`` carries each NaN max slot
    as +inf and a count in the additive part (see ``sum_part``).

    A step of python numbers only packs into ``reuse`` (made by ``SendBuffer.make``
    with this ``max_tail``) when given, and returns its tensor.
    """
    if not layout.extra_slots and not nan_counts:
        send = reuse if reuse is not None else SendBuffer.make(layout, max_tail)
        if _pack_plain(accs, layout, send.array):
            return send.tensor if device.type == "cpu" else send.tensor.to(device)
    count = len(accs)
    flags = list(map(_get_flags, accs))
    sums = np.zeros(layout.num_sums)
    sums[: layout.num_kind_sums] = np.fromiter(
        chain.from_iterable(map(_get_sums, accs)), np.float64, count=layout.num_kind_sums
    )
    if flags.count(None) != count:
        rows = [i for i, f in enumerate(flags) if f is not None]
        sums[layout.flag_positions[rows]] = [flags[i] for i in rows]
    maxes = _host_maxes(accs, layout)
    dev_sums = list(map(_get_dev_sums, accs))
    if dev_sums.count(None) != count:  # device parts (dev_maxes is set only with dev_sums)
        dev_maxes = list(map(_get_dev_maxes, accs))
        sum_rows = [i for i, t in enumerate(dev_sums) if t is not None]
        max_rows = [i for i, t in enumerate(dev_maxes) if t is not None]
        if device.type != "cpu" or not _all_on_cpu(dev_sums, dev_maxes, sum_rows, max_rows):
            return _merge_device(
                layout, sums, maxes, dev_sums, dev_maxes, device, max_tail, nan_counts
            )
        # CPU tensors: fold them in with numpy (no device to wait on, far fewer dispatches)
        index = np.concatenate([layout.sum_positions[i] for i in sum_rows])
        sums[index] += torch.cat([dev_sums[i] for i in sum_rows]).numpy()
        if max_rows:
            index = np.concatenate([layout.max_positions[i] for i in max_rows])
            maxes[index] = np.maximum(
                maxes[index], torch.cat([dev_maxes[i] for i in max_rows]).numpy()
            )
    parts = [sums]
    if nan_counts:  # NaN bookkeeping in numpy (see _merge_device), one transfer
        is_nan = np.isnan(maxes)
        if is_nan.any():
            maxes[is_nan] = math.inf
        parts.append(is_nan)
    parts += [maxes, np.asarray(max_tail, dtype=np.float64)]
    buffer = torch.from_numpy(np.concatenate(parts, dtype=np.float64))
    return buffer if device.type == "cpu" else buffer.to(device)


@dataclass(frozen=True)
class SendBuffer:
    """A packed buffer for steps of python numbers only, as an array and a tensor over
    the same memory; its counts block is zero and its tail written once."""

    array: np.ndarray
    tensor: Tensor

    @classmethod
    def make(cls, layout: Layout, max_tail: Sequence[float] | np.ndarray) -> SendBuffer:
        array = np.zeros(layout.num_sums + layout.num_maxes + len(max_tail))
        array[layout.num_sums + layout.num_maxes :] = max_tail
        return cls(array, torch.from_numpy(array))


def _pack_plain(accs: Sequence[Accumulator], layout: Layout, buffer: np.ndarray) -> bool:
    """Pack the common step (host numbers only, no counts) into ``buffer``'s SUM and MAX
    slots: one pass over the accumulators, one conversion per part. False, with
    ``buffer`` untouched, when some metric is not that plain."""
    sums: list[float] = []
    maxes: list[float] = []
    for acc in accs:
        if acc.flags is not None or acc.dev_sums is not None:
            return False
        sums += acc.sums
        maxes += acc.maxes
    layout.sum_struct.pack_into(buffer, 0, *sums)
    layout.max_struct.pack_into(buffer, 8 * layout.num_sums, *maxes)
    return True


def sum_part(layout: Layout, nan_counts: bool = False) -> int:
    """The length of a packed buffer's additive part (SUM slots, and NaN counts when
    packed with them)."""
    return layout.num_sums + (layout.num_maxes if nan_counts else 0)


def _all_on_cpu(
    dev_sums: list[Tensor | None],
    dev_maxes: list[Tensor | None],
    sum_rows: list[int],
    max_rows: list[int],
) -> bool:
    return all(dev_sums[i].device.type == "cpu" for i in sum_rows) and all(
        dev_maxes[i].device.type == "cpu" for i in max_rows
    )


_get_sums = attrgetter("sums")
_get_maxes = attrgetter("maxes")
_get_flags = attrgetter("flags")
_get_dev_sums = attrgetter("dev_sums")
_get_dev_maxes = attrgetter("dev_maxes")


def in_order(accumulators: Mapping[str, Accumulator], layout: Layout) -> list[Accumulator]:
    """The accumulators in layout order, blanks where this process logged nothing.

    Raises:
        KeyError: an accumulator's name is not in the layout.
    """
    accs = list(map(accumulators.get, layout.names))
    missing = accs.count(None)
    if len(accs) - missing != len(accumulators):
        unknown = next(name for name in accumulators if name not in layout.index)
        raise KeyError(unknown)
    if missing:
        accs = [b if a is None else a for a, b in zip(accs, layout.blanks, strict=True)]
    return accs


def _host_maxes(accs: Sequence[Accumulator], layout: Layout) -> np.ndarray:
    """The host half of the MAX buffer (extra-size slots filled in for extra kinds)."""
    kind_maxes = chain.from_iterable(map(_get_maxes, accs))
    if not layout.extra_slots:
        return np.fromiter(kind_maxes, np.float64, count=layout.num_maxes)
    positions = layout.kind_max_positions
    maxes = np.full(layout.num_maxes, -math.inf)
    maxes[positions] = np.fromiter(kind_maxes, np.float64, count=len(positions))
    blanks = layout.blanks
    for slot in layout.extra_slots:
        position = layout.index[slot.name]
        acc = accs[position]
        if acc is not blanks[position]:
            maxes[slot.max_offset + slot.kind.num_maxes] = slot.kind.extra_size(acc)
    return maxes


def _merge_device(
    layout: Layout,
    sums: np.ndarray,
    maxes: np.ndarray,
    dev_sums: list[Tensor | None],
    dev_maxes: list[Tensor | None],
    device: torch.device,
    max_tail: Sequence[float] | np.ndarray,
    nan_counts: bool,
) -> Tensor:
    """Add the device halves to the host halves on ``device`` (no host sync)."""
    sum_buffer = torch.from_numpy(sums).to(device)
    max_buffer = torch.from_numpy(maxes).to(device)
    sum_rows = [i for i, t in enumerate(dev_sums) if t is not None]
    if sum_rows:
        index = [layout.sum_positions[i] for i in sum_rows]
        parts = [dev_sums[i] for i in sum_rows]
        sum_buffer = sum_buffer + _scatter(index, parts, layout.num_sums, 0.0, device)
    max_rows = [i for i, t in enumerate(dev_maxes) if t is not None]
    if max_rows:
        index = [layout.max_positions[i] for i in max_rows]
        parts = [dev_maxes[i] for i in max_rows]
        dev = _scatter(index, parts, layout.num_maxes, -math.inf, device)
        max_buffer = torch.maximum(max_buffer, dev)
    parts = [sum_buffer]
    if nan_counts:  # carry NaN as +inf in MAX and as a count per max slot in SUM
        is_nan = torch.isnan(max_buffer)
        max_buffer = torch.where(is_nan, math.inf, max_buffer)
        parts.append(is_nan.double())
    parts.append(max_buffer)
    if len(max_tail):  # a host-to-device copy, like the host halves above
        parts.append(torch.from_numpy(np.asarray(max_tail, dtype=np.float64)).to(device))
    return torch.cat(parts)


def _scatter(
    index: list[np.ndarray], parts: list[Tensor], size: int, fill: float, device: torch.device
) -> Tensor:
    """A ``size`` buffer on ``device`` holding ``parts`` at ``index``, ``fill`` elsewhere."""
    out = torch.full((size,), fill, dtype=torch.float64, device=device)
    positions = torch.from_numpy(np.concatenate(index)).to(device)
    out.index_put_(
        (positions,), torch.cat([p if p.device == device else p.to(device) for p in parts])
    )
    return out


def restore_nans(sums: np.ndarray, maxes: np.ndarray, layout: Layout) -> np.ndarray:
    """The MAX part (tail included) of an all-reduced buffer packed with ``nan_counts``,
    with NaN back where any rank had one; ``sums`` is the whole additive part."""
    counts = sums[layout.num_sums :]
    if not counts.any():
        return maxes
    maxes = maxes.copy()
    maxes[: layout.num_maxes][counts > 0] = math.nan
    return maxes


def extra_sizes(layout: Layout, maxes: np.ndarray) -> list[int]:
    """The padded extra size of each extra slot, read from a (reduced) MAX buffer."""
    sizes = [maxes[slot.max_offset + slot.kind.num_maxes] for slot in layout.extra_slots]
    return [int(size) if size > 0 else 0 for size in sizes]  # -inf: no rank logged it


def pack_extras(
    accumulators: Mapping[str, Accumulator],
    layout: Layout,
    sizes: Sequence[int],
    device: torch.device,
) -> tuple[Tensor, dict[str, object]]:
    """This process's gather buffer (packable extras, padded to ``sizes``) and the host
    extras of kinds that cannot be packed (these travel by object gather)."""
    vectors: list[Tensor] = []
    objects: dict[str, object] = {}
    for slot, size in zip(layout.extra_slots, sizes, strict=True):
        acc = accumulators.get(slot.name)
        vector = slot.kind.extra_vector(acc, device, size)
        if vector is None:
            objects[slot.name] = host_extra(acc) if acc is not None else slot.kind.empty_extra()
        else:
            vectors.append(vector)
    if not vectors:
        return torch.zeros(0, dtype=torch.float64, device=device), objects
    return torch.cat(vectors), objects


def host_extra(acc: Accumulator) -> object:
    """An accumulator's whole extra on the host (host part merged with device part)."""
    kind = acc.kind
    if acc.dev_extra is None:
        return acc.extra
    return kind.merge_extra(acc.extra, kind.host_extra(acc.dev_extra))


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
    counts = sums[layout.num_kind_sums :]
    counted = bool(counts.any())  # counts, never negative
    if counted:
        rejected = counts[1::NUM_FLAGS]
        if rejected.any():
            _raise_rejected(layout, rejected)
    extra_values = _split_extras(layout, extras, objects, sizes) if layout.extra_slots else {}
    keep = None if logged is None or logged.all() else logged > 0
    return Reduced(layout, sums, maxes[: layout.num_maxes], extra_values, keep, counted)


def _raise_rejected(layout: Layout, counts: np.ndarray) -> None:
    rejected = [
        f"{slot.name!r} ({slot.kind.name}): {int(n)}"
        for slot, n in zip(layout.slots, counts, strict=True)
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
    merged: dict[str, object] = {}
    offsets = [0] * len(extras)
    for slot, size in zip(layout.extra_slots, sizes, strict=True):
        kind = slot.kind
        value = kind.empty_extra()
        if slot.name in (objects[0] if objects else {}):
            for rank_objects in objects:
                value = kind.merge_extra(value, rank_objects[slot.name])
        else:
            length = kind.vector_length(size)
            for rank, buffer in enumerate(extras):
                piece = buffer[offsets[rank] : offsets[rank] + length]
                offsets[rank] += length
                value = kind.merge_extra(value, kind.extra_from_vector(piece))
        merged[slot.name] = value
    return merged


def local_reduce(
    accumulators: Mapping[str, Accumulator], layout: Layout, device: torch.device
) -> Reduced:
    """This process's step, with one device-to-host transfer per buffer."""
    accs = in_order(accumulators, layout)
    host = pack_scalars(accs, layout, device).cpu().numpy()
    sums, maxes = host[: layout.num_sums], host[layout.num_sums :]
    sizes = extra_sizes(layout, maxes)
    extras, objects = pack_extras(accumulators, layout, sizes, device)
    return unpack(layout, sums, maxes, [extras.cpu().numpy()], [objects], sizes)
