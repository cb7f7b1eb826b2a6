"""A merged step in packed form: states and results read straight from the buffers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from rlmetrics.kinds.base import MetricState
from rlmetrics.layout import Layout
from rlmetrics.results import KindRows, results


@dataclass(frozen=True, slots=True)
class Reduced:
    """One merged step in packed form; states and results are read from it lazily.

    Attributes:
        layout: where each metric's slots are.
        sums: the SUM part (the kinds' sums, then two framework counts per metric).
        maxes: the MAX part (the kinds' max slots and the extra-size slots).
        extras: each extra kind's merged extra, by name.
        keep: per slot, whether any rank logged the name this step (None: every one).
    """

    layout: Layout
    sums: np.ndarray
    maxes: np.ndarray
    extras: Mapping[str, object]
    keep: np.ndarray | None

    def states(self) -> dict[str, MetricState]:
        """Per metric, its merged state, by name (names no rank logged are left out)."""
        layout, keep = self.layout, self.keep
        sums, maxes = self.sums.tolist(), self.maxes.tolist()
        prints = {id(kind): kind.fingerprint() for kind in layout.kinds}
        states = {}
        for i, slot in enumerate(layout.slots):
            if keep is not None and not keep[i]:
                continue
            kind = slot.kind
            states[slot.name] = MetricState(
                kind.name,
                tuple(sums[slot.sum_offset : slot.sum_offset + kind.num_sums]),
                tuple(maxes[slot.max_offset : slot.max_offset + kind.num_maxes]),
                self.extras.get(slot.name),
                float(sums[slot.flag_offset]),
                prints[id(kind)],
            )
        return states

    def results(self, *, empty: str) -> dict[str, float]:
        """Every metric's values, as ``compute()`` reports them."""
        layout = self.layout
        groups = [
            KindRows(
                group.kind,
                group.rows,
                self.sums[group.sums],
                self.maxes[group.maxes],
                [self.extras[layout.names[i]] for i in group.rows.tolist()]
                if group.kind.has_extra
                else None,
            )
            for group in layout.kind_groups
        ]
        nonfinite = self.sums[layout.num_kind_sums :: 2]
        return results(layout.names, groups, nonfinite=nonfinite, keep=self.keep, empty=empty)
