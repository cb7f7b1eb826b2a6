"""Where each metric of an agreed schema lives in the packed buffers.

A ``Layout`` fixes, for an agreed set of (name, kind) pairs, each metric's additive
slots and framework counts in the SUM buffer, its max slots in the MAX buffer and (for
kinds with an extra payload) its piece of the gather buffer; the index arrays that
packing and unpacking use are built once per layout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from operator import attrgetter, is_

import numpy as np

from rlmetrics.kinds.base import NUM_FLAGS, Accumulator, Kind

_get_kind = attrgetter("kind")


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one metric lives in the packed buffers."""

    name: str
    kind: Kind
    sum_offset: int  # the kind's sums
    flag_offset: int  # the framework counts: [num_nonfinite, num_rejected]
    max_offset: int
    num_maxes: int  # the kind's maxes plus one extra-size slot for kinds with an extra


@dataclass(frozen=True, slots=True)
class KindGroup:
    """The metrics of one kind: their rows, and the (rows, slots) SUM and MAX positions
    of their slots."""

    kind: Kind
    rows: np.ndarray
    sums: np.ndarray
    maxes: np.ndarray


class Layout:
    """The packed positions of an agreed schema.

    Metrics are ordered by name (results are reported in that order). The SUM part is
    [every metric's kind sums | two framework counts per metric]; the MAX part holds the
    kinds' max slots (and each extra kind's extra size). Index arrays used by packing and
    unpacking are built once per layout (lazily), so a steady-state step does no
    per-metric bookkeeping beyond reading the states.
    """

    def __init__(self, schema: Sequence[tuple[str, Kind]]) -> None:
        ordered = sorted(schema, key=lambda item: item[0])
        self.num_kind_sums = sum(kind.num_sums for _, kind in ordered)
        self.slots: list[Slot] = []
        self.index: dict[str, int] = {}
        sum_offset = max_offset = 0
        flag_offset = self.num_kind_sums
        for name, kind in ordered:
            num_maxes = kind.num_maxes + (1 if kind.has_extra else 0)
            self.index[name] = len(self.slots)
            self.slots.append(Slot(name, kind, sum_offset, flag_offset, max_offset, num_maxes))
            sum_offset += kind.num_sums
            flag_offset += NUM_FLAGS
            max_offset += num_maxes
        self.num_sums = flag_offset
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
    def kind_groups(self) -> list[KindGroup]:
        """The metrics grouped by kind object, each group's rows in order."""
        rows: dict[int, list[int]] = {}
        for i, kind in enumerate(self.kinds):
            rows.setdefault(id(kind), []).append(i)
        groups = []
        for members in rows.values():
            kind, count = self.kinds[members[0]], len(members)
            slots = [self.slots[i] for i in members]
            sums = [s.sum_offset + np.arange(kind.num_sums) for s in slots]
            maxes = [s.max_offset + np.arange(kind.num_maxes) for s in slots]
            groups.append(
                KindGroup(
                    kind,
                    np.array(members, dtype=np.int64),
                    np.array(sums, dtype=np.int64).reshape(count, kind.num_sums),
                    np.array(maxes, dtype=np.int64).reshape(count, kind.num_maxes),
                )
            )
        return groups
