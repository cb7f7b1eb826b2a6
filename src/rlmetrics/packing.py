"""Packing many metrics' states into a few flat buffers, and back.

A ``Layout`` fixes where each (name, kind) of a schema lives: its additive slots in the
SUM buffer, its max slots in the MAX buffer, and (for kinds with an extra payload) its
piece of the gather buffer. Packing copies host floats in one transfer and device
tensors with one index_put per buffer: the host never waits on the device here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rlmetrics.kinds.base import (
    NONFINITE_SLOT,
    NUM_FLAGS,
    REJECTED_SLOT,
    Accumulator,
    Kind,
    MetricState,
)


class RejectedInputError(ValueError):
    """Tensor log calls were rejected on the device (negative or non-finite weights, or
    non-finite values under ``nonfinite="error"``) and dropped; raised at step end."""


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one metric lives in the packed buffers."""

    name: str
    kind: Kind
    sum_offset: int
    num_sums: int  # the kind's sums plus the framework flags
    max_offset: int
    num_maxes: int  # the kind's maxes plus one extra-size slot for kinds with an extra


class Layout:
    """The packed positions of an agreed schema (sorted (name, kind) pairs)."""

    def __init__(self, schema: Sequence[tuple[str, Kind]]) -> None:
        self.slots: list[Slot] = []
        self.index: dict[str, int] = {}
        sum_offset = max_offset = 0
        for name, kind in sorted(schema, key=lambda item: item[0]):
            num_sums = kind.num_sums + NUM_FLAGS
            num_maxes = kind.num_maxes + (1 if kind.has_extra else 0)
            self.index[name] = len(self.slots)
            self.slots.append(Slot(name, kind, sum_offset, num_sums, max_offset, num_maxes))
            sum_offset += num_sums
            max_offset += num_maxes
        self.num_sums = sum_offset
        self.num_maxes = max_offset
        self.extra_slots = [slot for slot in self.slots if slot.kind.has_extra]
        self.signature = tuple((slot.name, slot.kind.fingerprint()) for slot in self.slots)

    def __contains__(self, name: str) -> bool:
        return name in self.index


def pack_scalars(
    accumulators: Mapping[str, Accumulator], layout: Layout, device: torch.device
) -> tuple[Tensor, Tensor]:
    """The SUM and MAX buffers of this process, float64 on ``device``.

    Metrics of the layout that this process never logged pack as empty states. The SUM
    buffer ends with ``layout.num_maxes`` NaN counts, one per max slot.
    """
    sums = np.zeros(layout.num_sums)
    maxes = np.full(layout.num_maxes, -math.inf)
    sum_index: list[np.ndarray] = []
    sum_parts: list[Tensor] = []
    max_index: list[np.ndarray] = []
    max_parts: list[Tensor] = []
    for name, acc in accumulators.items():
        slot = layout.slots[layout.index[name]]
        sums[slot.sum_offset : slot.sum_offset + slot.num_sums] = acc.sums
        kind_maxes = slot.kind.num_maxes
        maxes[slot.max_offset : slot.max_offset + kind_maxes] = acc.maxes
        if slot.kind.has_extra:
            maxes[slot.max_offset + kind_maxes] = slot.kind.extra_size(acc)
        if acc.dev_sums is not None:
            sum_index.append(np.arange(slot.sum_offset, slot.sum_offset + slot.num_sums))
            sum_parts.append(acc.dev_sums)
        if acc.dev_maxes is not None:
            max_index.append(np.arange(slot.max_offset, slot.max_offset + kind_maxes))
            max_parts.append(acc.dev_maxes)
    sum_buffer = torch.from_numpy(sums).to(device)
    max_buffer = torch.from_numpy(maxes).to(device)
    if sum_parts:
        sum_buffer = sum_buffer + _scatter(sum_index, sum_parts, layout.num_sums, 0.0, device)
    if max_parts:
        dev = _scatter(max_index, max_parts, layout.num_maxes, -math.inf, device)
        max_buffer = torch.maximum(max_buffer, dev)
    # all_reduce(MAX) need not propagate NaN (gloo does not, symmetrically): carry NaN
    # as +inf in MAX and as a count per max slot at the SUM buffer's tail.
    is_nan = torch.isnan(max_buffer)
    max_buffer = torch.where(is_nan, math.inf, max_buffer)
    return torch.cat((sum_buffer, is_nan.double())), max_buffer


def _scatter(
    index: list[np.ndarray], parts: list[Tensor], size: int, fill: float, device: torch.device
) -> Tensor:
    """A ``size`` buffer on ``device`` holding ``parts`` at ``index``, ``fill`` elsewhere."""
    out = torch.full((size,), fill, dtype=torch.float64, device=device)
    positions = torch.from_numpy(np.concatenate(index)).to(device)
    out.index_put_((positions,), torch.cat([p.to(device) for p in parts]))
    return out


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
) -> dict[str, MetricState]:
    """Reduced buffers back into per-metric states.

    ``extras`` holds one gather buffer per rank (rank order) and ``objects`` one dict of
    object extras per rank; each rank's extras are merged in rank order.

    Raises:
        RejectedInputError: a metric received rejected input (negative weights, or non-finite
            values under ``nonfinite="error"``) in a tensor log call.
    """
    counts = [
        (slot, sums[slot.sum_offset + slot.num_sums + REJECTED_SLOT]) for slot in layout.slots
    ]
    rejected = [f"{slot.name!r} ({slot.kind.name}): {int(n)}" for slot, n in counts if n > 0]
    if rejected:
        raise RejectedInputError(
            "tensor log calls were rejected (negative or non-finite weights, or non-finite "
            "values under nonfinite='error') and dropped; rejected calls per metric: "
            + ", ".join(rejected)
        )
    extra_values = _split_extras(layout, extras, objects, sizes)
    maxes = np.where(sums[layout.num_sums :] > 0, math.nan, maxes)
    states: dict[str, MetricState] = {}
    for slot in layout.slots:
        slot_sums = sums[slot.sum_offset : slot.sum_offset + slot.num_sums]
        slot_maxes = maxes[slot.max_offset : slot.max_offset + slot.kind.num_maxes]
        states[slot.name] = MetricState(
            slot.kind.name,
            tuple(slot_sums[: slot.kind.num_sums].tolist()),
            tuple(slot_maxes.tolist()),
            extra_values.get(slot.name),
            float(slot_sums[NONFINITE_SLOT]),
        )
    return states


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


def local_states(
    accumulators: Mapping[str, Accumulator], layout: Layout, device: torch.device
) -> dict[str, MetricState]:
    """This process's states, with one device-to-host transfer per buffer."""
    sums, maxes = pack_scalars(accumulators, layout, device)
    maxes_host = maxes.cpu().numpy()
    sizes = extra_sizes(layout, maxes_host)
    extras, objects = pack_extras(accumulators, layout, sizes, device)
    return unpack(layout, sums.cpu().numpy(), maxes_host, [extras.cpu().numpy()], [objects], sizes)
