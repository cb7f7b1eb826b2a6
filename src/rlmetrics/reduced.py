"""A merged step in packed form: states and results read straight from the buffers."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import compress

import numpy as np

from rlmetrics.kinds.base import Kind, MetricState
from rlmetrics.layout import Layout
from rlmetrics.state import results


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
