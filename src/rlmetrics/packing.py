"""Packing many metrics' states into a few flat buffers, and back.

A ``Layout`` fixes where each (name, kind) of a schema lives: its additive slots in the
SUM buffer, its max slots in the MAX buffer, and (for kinds with an extra payload) its
piece of the gather buffer. Packing copies host floats in one transfer and device
tensors with one index_put per buffer: the host never waits on the device here.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from itertools import chain, compress
from operator import attrgetter, is_, is_not

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
from rlmetrics.state import results


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
    """The packed positions of an agreed schema (sorted (name, kind) pairs).

    Index arrays used by packing and unpacking are built once per layout (lazily), so a
    steady-state step does no per-metric bookkeeping beyond reading the states.
    """

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
        self.names = [slot.name for slot in self.slots]
        self.kinds = [slot.kind for slot in self.slots]

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def fits(self, accumulators: Mapping[str, Accumulator]) -> bool:
        """Whether every name of ``accumulators`` is here, with the same kind object."""
        if not accumulators.keys() <= self.index.keys():
            return False
        kinds = map(self.kinds.__getitem__, map(self.index.__getitem__, accumulators))
        return all(map(is_, map(_get_kind, accumulators.values()), kinds))

    @cached_property
    def digest(self) -> float:
        """A float64-exact 52-bit hash of the signature, equal on ranks with equal layouts."""
        digest = hashlib.blake2b(repr(self.signature).encode(), digest_size=8).digest()
        return float(int.from_bytes(digest, "little") >> 12)

    @cached_property
    def blanks(self) -> list[Accumulator]:
        """Per slot, an empty stand-in (read only) for a metric this process never logged."""
        return [
            Accumulator(s.kind, [0.0] * s.num_sums, [-math.inf] * s.kind.num_maxes)
            for s in self.slots
        ]

    @cached_property
    def kind_max_positions(self) -> np.ndarray:
        """MAX-buffer positions of the kinds' own max slots (extra-size slots excluded)."""
        return np.concatenate(
            [np.arange(s.max_offset, s.max_offset + s.kind.num_maxes) for s in self.slots]
            or [np.zeros(0, dtype=np.int64)]
        )

    @cached_property
    def sum_positions(self) -> list[np.ndarray]:
        """Per slot, its SUM-buffer positions (framework flags included)."""
        return [np.arange(s.sum_offset, s.sum_offset + s.num_sums) for s in self.slots]

    @cached_property
    def max_positions(self) -> list[np.ndarray]:
        """Per slot, the MAX-buffer positions of the kind's own max slots."""
        return [np.arange(s.max_offset, s.max_offset + s.kind.num_maxes) for s in self.slots]

    @cached_property
    def rejected_positions(self) -> np.ndarray:
        """SUM-buffer positions of every slot's rejected-call count."""
        return np.array(
            [s.sum_offset + s.num_sums + REJECTED_SLOT for s in self.slots], dtype=np.int64
        )

    @cached_property
    def kind_names(self) -> list[str]:
        """Per slot, the kind's registered name."""
        return [slot.kind.name for slot in self.slots]

    @cached_property
    def sum_slices(self) -> list[slice]:
        """Per slot, the kind's own SUM-buffer slots (framework flags excluded)."""
        return [slice(s.sum_offset, s.sum_offset + s.kind.num_sums) for s in self.slots]

    @cached_property
    def max_slices(self) -> list[slice]:
        """Per slot, the kind's own MAX-buffer slots (extra-size slot excluded)."""
        return [slice(s.max_offset, s.max_offset + s.kind.num_maxes) for s in self.slots]

    @cached_property
    def vector_groups(self) -> dict[Kind, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per kind with a ``results_vector`` (and no extra): its rows, and the (n, k)
        SUM and MAX positions of their slots."""
        rows: dict[Kind, list[int]] = {}
        for i, slot in enumerate(self.slots):
            if _vectorised(slot.kind):
                rows.setdefault(slot.kind, []).append(i)
        groups = {}
        for kind, members in rows.items():
            sums = [
                np.arange(self.slots[i].sum_offset, self.slots[i].sum_offset + kind.num_sums)
                for i in members
            ]
            maxes = [
                np.arange(self.slots[i].max_offset, self.slots[i].max_offset + kind.num_maxes)
                for i in members
            ]
            groups[kind] = (
                np.array(members, dtype=np.int64),
                np.array(sums, dtype=np.int64).reshape(len(members), kind.num_sums),
                np.array(maxes, dtype=np.int64).reshape(len(members), kind.num_maxes),
            )
        return groups

    @cached_property
    def slow_rows(self) -> np.ndarray:
        """Per slot, True when its kind has no vectorised results."""
        return np.array([not _vectorised(slot.kind) for slot in self.slots], dtype=bool)

    @cached_property
    def nonfinite_array(self) -> np.ndarray:
        """``nonfinite_positions`` as an index array."""
        return np.array(self.nonfinite_positions, dtype=np.int64)

    @cached_property
    def nonfinite_positions(self) -> list[int]:
        """Per slot, the SUM-buffer position of its non-finite count."""
        return [s.sum_offset + s.num_sums + NONFINITE_SLOT for s in self.slots]


def _vectorised(kind: Kind) -> bool:
    return not kind.has_extra and type(kind).results_vector is not Kind.results_vector


def pack_scalars(
    accumulators: Mapping[str, Accumulator],
    layout: Layout,
    device: torch.device,
    *,
    max_tail: Sequence[float] = (),
) -> tuple[Tensor, Tensor]:
    """The SUM and MAX buffers of this process, float64 on ``device``.

    Metrics of the layout that this process never logged pack as empty states. The SUM
    buffer ends with ``layout.num_maxes`` NaN counts, one per max slot; the MAX buffer
    ends with ``max_tail`` (taken as is).
    """
    accs = _in_order(accumulators, layout)
    sums = np.fromiter(chain.from_iterable(map(_get_sums, accs)), np.float64, count=layout.num_sums)
    maxes = _host_maxes(accs, layout)
    dev_sums = list(map(_get_dev_sums, accs))
    dev_maxes = list(map(_get_dev_maxes, accs))
    if not (any(map(_is_set, dev_sums)) or any(map(_is_set, dev_maxes))):
        # all host: NaN bookkeeping in numpy, one transfer per buffer
        is_nan = np.isnan(maxes)
        maxes[is_nan] = math.inf
        sum_buffer = np.concatenate((sums, is_nan.astype(np.float64)))
        max_buffer = np.concatenate((maxes, np.asarray(max_tail, dtype=np.float64)))
        return torch.from_numpy(sum_buffer).to(device), torch.from_numpy(max_buffer).to(device)
    return _merge_device(layout, sums, maxes, dev_sums, dev_maxes, device, max_tail)


_get_kind = attrgetter("kind")
_get_sums = attrgetter("sums")
_get_maxes = attrgetter("maxes")
_get_dev_sums = attrgetter("dev_sums")
_get_dev_maxes = attrgetter("dev_maxes")
_is_set = partial(is_not, None)


def _in_order(accumulators: Mapping[str, Accumulator], layout: Layout) -> list[Accumulator]:
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


def _host_maxes(accs: list[Accumulator], layout: Layout) -> np.ndarray:
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
    max_tail: Sequence[float],
) -> tuple[Tensor, Tensor]:
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
    # all_reduce(MAX) need not propagate NaN (gloo does not, symmetrically): carry NaN
    # as +inf in MAX and as a count per max slot at the SUM buffer's tail.
    is_nan = torch.isnan(max_buffer)
    max_buffer = torch.where(is_nan, math.inf, max_buffer)
    if max_tail:
        tail = torch.tensor(max_tail, dtype=torch.float64, device=device)
        max_buffer = torch.cat((max_buffer, tail))
    return torch.cat((sum_buffer, is_nan.double())), max_buffer


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

    ``extras`` holds one gather buffer per rank (rank order) and ``objects`` one dict of
    object extras per rank; each rank's extras are merged in rank order.

    Raises:
        RejectedInputError: a metric received rejected input (negative weights, or
            non-finite values under ``nonfinite="error"``) in a tensor log call.
    """
    rejected_counts = sums[layout.rejected_positions]
    if (rejected_counts > 0).any():
        _raise_rejected(layout, rejected_counts)
    extra_values = _split_extras(layout, extras, objects, sizes) if layout.extra_slots else {}
    nan_maxes = np.where(sums[layout.num_sums :] > 0, math.nan, maxes[: layout.num_maxes])
    keep = np.ones(len(layout.slots), dtype=bool) if logged is None else np.asarray(logged) > 0
    return Reduced(layout, sums, nan_maxes, extra_values, keep)


@dataclass(frozen=True, slots=True)
class Reduced:
    """One merged step in packed form; states and results are read from it lazily.

    Attributes:
        layout: where each metric's slots are.
        sums: the SUM buffer (the NaN-count tail included).
        maxes: the kinds' max slots with NaN restored (extra-size slots included).
        extras: each extra kind's merged extra, by name.
        keep: per slot, whether any rank logged the name this step.
    """

    layout: Layout
    sums: np.ndarray
    maxes: np.ndarray
    extras: Mapping[str, object]
    keep: np.ndarray

    def states(self) -> dict[str, MetricState]:
        """Per metric, its merged state (names no rank logged are left out)."""
        layout = self.layout
        s, m = self.sums.tolist(), self.maxes.tolist()
        states = map(
            MetricState,
            layout.kind_names,
            map(tuple, map(s.__getitem__, layout.sum_slices)),
            map(tuple, map(m.__getitem__, layout.max_slices)),
            map(self.extras.get, layout.names),
            map(s.__getitem__, layout.nonfinite_positions),
        )
        pairs = zip(layout.names, states, strict=True)
        if self.keep.all():
            return dict(pairs)
        return {name: state for (name, state), kept in zip(pairs, self.keep, strict=True) if kept}

    def results(self, kind_of: Callable[[str], Kind], *, empty: str) -> dict[str, float]:
        """Every metric's values, as ``state.results`` gives them, vectorised by kind.

        Kinds with a ``results_vector`` are computed a whole kind at a time; metrics of
        other kinds, or with non-finite counts to report, go through ``kind.result``.
        """
        layout = self.layout
        values, present, slow = self._vector_results()
        slow &= self.keep
        if empty == "nan":
            present = present | ~slow
        if not slow.any():
            shown = present & self.keep
            return dict(zip(compress(layout.names, shown), values[shown].tolist(), strict=True))
        slow_rows = set(np.flatnonzero(slow).tolist())
        out: dict[str, float] = {}
        emitted = 0
        for i in np.flatnonzero(self.keep).tolist():
            name = layout.names[i]
            if i in slow_rows:
                state = self._state(i)
                part = results({name: state}, kind_of, empty=empty)
                out.update(part)
                emitted += len(part)
            elif present[i]:
                out[name] = float(values[i])
                emitted += 1
        if len(out) != emitted:
            results(self.states(), kind_of, empty=empty)  # raises, naming the clash
        return out

    def _vector_results(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(values, present, needs the slow path) per slot."""
        layout = self.layout
        size = len(layout.slots)
        values = np.full(size, math.nan)
        present = np.zeros(size, dtype=bool)
        slow = layout.slow_rows.copy()
        slow |= self.sums[layout.nonfinite_array] > 0
        for kind, (rows, sum_index, max_index) in layout.vector_groups.items():
            out = kind.results_vector(self.sums[sum_index], self.maxes[max_index])
            if out is None:
                slow[rows] = True
                continue
            values[rows], present[rows] = out
        values[~present] = math.nan
        return values, present, slow

    def _state(self, i: int) -> MetricState:
        layout, slot = self.layout, self.layout.slots[i]
        return MetricState(
            slot.kind.name,
            tuple(self.sums[layout.sum_slices[i]].tolist()),
            tuple(self.maxes[layout.max_slices[i]].tolist()),
            self.extras.get(slot.name),
            float(self.sums[layout.nonfinite_positions[i]]),
        )


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
    sums, maxes = pack_scalars(accumulators, layout, device)
    maxes_host = maxes.cpu().numpy()
    sizes = extra_sizes(layout, maxes_host)
    extras, objects = pack_extras(accumulators, layout, sizes, device)
    return unpack(layout, sums.cpu().numpy(), maxes_host, [extras.cpu().numpy()], [objects], sizes)
