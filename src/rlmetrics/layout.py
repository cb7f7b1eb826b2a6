"""Where each metric of an agreed schema lives in the packed buffers.

A ``Layout`` fixes, for sorted (name, kind) pairs, each metric's additive slots in the
SUM buffer, its max slots in the MAX buffer and (for kinds with an extra payload) its
piece of the gather buffer; the index arrays that packing and unpacking use are built
once per layout.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from operator import attrgetter, is_

import numpy as np

from rlmetrics.kinds.base import NONFINITE_SLOT, NUM_FLAGS, REJECTED_SLOT, Accumulator, Kind

_get_kind = attrgetter("kind")


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
