"""Where each metric of an agreed schema lives in the packed buffers.

A ``BufferLayout`` fixes where each metric of a set of (name, kind) pairs lives. Its
additive slots and framework counts go in the SUM buffer, and its max slots in the MAX
buffer. A kind with an extra payload also gets a piece of the gather buffer.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from operator import attrgetter, is_, itemgetter

import numpy as np

from rlmetrics._engine.record import MetricRecords
from rlmetrics.kinds.base import NUM_COUNTS, Kind

_get_kind = attrgetter("kind")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one metric lives in the packed buffers."""

    name: str
    kind: Kind
    sum_offset: int  # the kind's sums
    count_offset: int  # the framework counts: [num_nonfinite, num_rejected]
    max_offset: int  # the kind's maxes, then (kinds with an extra) the extra's size


@dataclass(frozen=True, slots=True)
class KindGroup:
    """The metrics of one kind object, side by side in both buffers.

    Their states are a ``sum_shape`` block of the SUM part and a ``max_shape`` block of
    the MAX part, read as views. Per metric, the MAX block holds the kind's max slots and
    an extra kind's extra size."""

    kind: Kind
    names: list[str]
    sums: slice
    maxes: slice
    sum_shape: tuple[int, int]
    max_shape: tuple[int, int]


class BufferLayout:
    """The packed positions of a schema.

    Metrics are ordered by name (``names``, ``slots``); results are reported in that
    order. In the buffers they are grouped by kind object (``groups``), so that each kind
    reads its metrics' states as one block. The SUM part is [every group's kind sums |
    two framework counts per metric, in name order]. The MAX part holds the groups' max
    slots and each extra kind's extra size.

    Ranks with equal ``signature``s (names, kinds and their ``settings()``) have equal
    positions and report alike. A layout agreed over a group
    (``rlmetrics._engine.sync.agree_schema``) holds one kind object per kind name. So its
    grouping follows the kind names, which the signature holds.
    """

    def __init__(self, schema: Sequence[tuple[str, Kind]]) -> None:
        ordered = sorted(schema, key=itemgetter(0))
        self.names = [name for name, _ in ordered]
        self.kinds = [kind for _, kind in ordered]
        self.index = {name: i for i, name in enumerate(self.names)}
        # copied and filled: no resize per result
        self.keys: dict[str, float] = dict.fromkeys(self.names, math.nan)
        members: dict[int, list[int]] = {}
        for i, kind in enumerate(self.kinds):
            members.setdefault(id(kind), []).append(i)
        self.num_kind_sums = sum(kind.num_sums for kind in self.kinds)
        placements: list[Placement | None] = [None] * len(ordered)
        self.groups: list[KindGroup] = []
        sum_offset = max_offset = 0
        order: list[int] = []  # the metrics in the groups' order
        for rows in members.values():
            order += rows
            kind = self.kinds[rows[0]]
            width = kind.num_maxes + (1 if kind.has_extra else 0)
            sums = slice(sum_offset, sum_offset + len(rows) * kind.num_sums)
            maxes = slice(max_offset, max_offset + len(rows) * width)
            names = [self.names[i] for i in rows]
            shapes = (len(rows), kind.num_sums), (len(rows), width)
            self.groups.append(KindGroup(kind, names, sums, maxes, *shapes))
            for i in rows:
                counts = self.num_kind_sums + i * NUM_COUNTS
                placements[i] = Placement(self.names[i], kind, sum_offset, counts, max_offset)
                sum_offset += kind.num_sums
                max_offset += width
        self.placements: list[Placement] = placements  # type: ignore[assignment]
        # per name, its position in the groups' order (to report values by name)
        self.by_name = np.argsort(np.array(order, dtype=np.int64))
        self.num_sums = self.num_kind_sums + NUM_COUNTS * len(ordered)
        self.num_maxes = max_offset
        self.extra_placements = [place for place in self.placements if place.kind.has_extra]
        settings = {id(group.kind): group.kind.settings() for group in self.groups}
        self.signature = tuple(
            (place.name, place.kind.name, settings[id(place.kind)]) for place in self.placements
        )

    def fits(self, metric_records: Mapping[str, MetricRecords]) -> bool:
        """Whether every name of ``metric_records`` is here, with the same kind object."""
        if not metric_records.keys() <= self.index.keys():
            return False
        kinds = map(self.kinds.__getitem__, map(self.index.__getitem__, metric_records))
        return all(map(is_, map(_get_kind, metric_records.values()), kinds))

    @cached_property
    def digest(self) -> float:
        """A float64-exact 52-bit hash of the signature, equal on ranks with equal layouts."""
        digest = hashlib.blake2b(repr(self.signature).encode(), digest_size=8).digest()
        return float(int.from_bytes(digest, "little") >> 12)
