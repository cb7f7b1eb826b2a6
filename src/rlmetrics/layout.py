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
    """The metrics of one kind with ``results_vector`` (and no extra or formula): their
    rows, and the (rows, slots) SUM and MAX positions of their slots."""

    kind: Kind
    rows: np.ndarray
    sums: np.ndarray
    maxes: np.ndarray


@dataclass(frozen=True, slots=True)
class Formulas:
    """Index arrays for the metrics whose kind has a ``result_formula``, into the
    reduced buffers read as one vector ``[*sums, *maxes, 1.0]``."""

    rows: np.ndarray | None  # their rows (None: every row)
    value: np.ndarray
    present: np.ndarray
    divisor: np.ndarray | None  # None: no kind divides (else 1.0 where one does not)
    negate: np.ndarray | None  # bool per formula row; None: none negates
    copy_at: np.ndarray | None  # positions (among the formula rows) with a negated copy
    copy: np.ndarray | None  # where those copies are


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
    def sum_slices(self) -> list[slice]:
        """Per slot, the kind's SUM-buffer slots."""
        return [slice(s.sum_offset, s.sum_offset + s.kind.num_sums) for s in self.slots]

    @cached_property
    def max_slices(self) -> list[slice]:
        """Per slot, the kind's own MAX-buffer slots (extra-size slot excluded)."""
        return [slice(s.max_offset, s.max_offset + s.kind.num_maxes) for s in self.slots]

    @cached_property
    def formulas(self) -> Formulas | None:
        """Where the formula kinds' results are read (None: no such kind here)."""
        one = self.num_sums + self.num_maxes

        def position(slot: Slot, index: int) -> int:  # in [*sums, *maxes]
            if index < slot.kind.num_sums:
                return slot.sum_offset + index
            return self.num_sums + slot.max_offset + index - slot.kind.num_sums

        rows, value, present, divisor, negate, copy_at, copy = [], [], [], [], [], [], []
        for row, slot in enumerate(self.slots):
            if not _formula(slot.kind):
                continue
            formula = slot.kind.result_formula
            if formula.negated_copy is not None:
                copy_at.append(len(rows))
                copy.append(position(slot, formula.negated_copy))
            rows.append(row)
            value.append(position(slot, formula.value))
            present.append(position(slot, formula.present))
            divisor.append(one if formula.divisor is None else position(slot, formula.divisor))
            negate.append(formula.negate)
        if not rows:
            return None

        def array(values: list) -> np.ndarray:
            return np.array(values, dtype=np.int64)

        return Formulas(
            None if len(rows) == len(self.slots) else array(rows),
            array(value),
            array(present),
            array(divisor) if any(d != one for d in divisor) else None,
            np.array(negate, dtype=bool) if any(negate) else None,
            array(copy_at) if copy_at else None,
            array(copy) if copy else None,
        )

    @cached_property
    def scalar_formulas(self) -> list[tuple[str, int, int, int | None, bool, int | None]] | None:
        """``formulas`` per metric as python values, when every metric's kind has a
        formula (else None): (name, value, present, divisor or None, negate, negated copy
        or None), positions in ``[*sums, *maxes]``."""
        f = self.formulas
        if f is None or f.rows is not None:
            return None
        one, count = self.num_sums + self.num_maxes, len(self.slots)
        divisors = [None] * count
        if f.divisor is not None:
            divisors = [None if d == one else d for d in f.divisor.tolist()]
        negates = [False] * count if f.negate is None else f.negate.tolist()
        copies: list[int | None] = [None] * count
        if f.copy is not None:
            for at, position in zip(f.copy_at.tolist(), f.copy.tolist(), strict=True):
                copies[at] = position
        values, presents = f.value.tolist(), f.present.tolist()
        return list(zip(self.names, values, presents, divisors, negates, copies, strict=True))

    @cached_property
    def vector_groups(self) -> list[KindGroup]:
        """Per kind with a ``results_vector`` (and no extra or formula), its metrics."""
        rows: dict[Kind, list[int]] = {}
        for i, slot in enumerate(self.slots):
            if _vectorised(slot.kind):
                rows.setdefault(slot.kind, []).append(i)
        groups = []
        for kind, members in rows.items():
            slots = [self.slots[i] for i in members]
            sums = [np.arange(s.sum_offset, s.sum_offset + kind.num_sums) for s in slots]
            maxes = [np.arange(s.max_offset, s.max_offset + kind.num_maxes) for s in slots]
            groups.append(
                KindGroup(
                    kind,
                    np.array(members, dtype=np.int64),
                    np.array(sums, dtype=np.int64).reshape(len(members), kind.num_sums),
                    np.array(maxes, dtype=np.int64).reshape(len(members), kind.num_maxes),
                )
            )
        return groups

    @cached_property
    def has_slow_rows(self) -> bool:
        """Whether any metric's kind has no vectorised results."""
        return bool(self.slow_rows.any())

    @cached_property
    def slow_rows(self) -> np.ndarray:
        """Per slot, True when its kind has neither a formula nor vectorised results."""
        return np.array(
            [not (_vectorised(s.kind) or _formula(s.kind)) for s in self.slots], dtype=bool
        )


def _vectorised(kind: Kind) -> bool:
    """Whether a kind's results come from ``results_vector``."""
    return (
        not kind.has_extra
        and kind.result_formula is None
        and type(kind).results_vector is not Kind.results_vector
    )


def _formula(kind: Kind) -> bool:
    """Whether a kind's results come from its ``result_formula``."""
    return not kind.has_extra and kind.result_formula is not None
