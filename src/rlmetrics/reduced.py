"""A merged step in packed form: states and results read straight from the buffers."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress

import numpy as np

from rlmetrics.kinds.base import NUM_FLAGS, Kind, MetricState
from rlmetrics.layout import Layout
from rlmetrics.state import results

_ONE = np.ones(1)


@dataclass(frozen=True, slots=True)
class Reduced:
    """One merged step in packed form; states and results are read from it lazily.

    Attributes:
        layout: where each metric's slots are.
        sums: the SUM part (the kinds' sums, then two framework counts per metric).
        maxes: the MAX part (the kinds' max slots and the extra-size slots).
        extras: each extra kind's merged extra, by name.
        keep: per slot, whether any rank logged the name this step (None: every one).
        counted: whether any framework count (non-finite elements) is not zero.
    """

    layout: Layout
    sums: np.ndarray
    maxes: np.ndarray
    extras: Mapping[str, object]
    keep: np.ndarray | None
    counted: bool = True

    def states(self) -> dict[str, MetricState]:
        """Per metric, its merged state, by name (names no rank logged are left out)."""
        layout, keep = self.layout, self.keep
        sums, maxes = self.sums.tolist(), self.maxes.tolist()
        return {
            layout.names[i]: self._state(i, sums, maxes)
            for i in layout.name_order.tolist()
            if keep is None or keep[i]
        }

    def results(self, kind_of: Callable[[str], Kind], *, empty: str) -> dict[str, float]:
        """Every metric's values, as ``state.results`` gives them, sorted by name.

        Kinds with a ``result_formula`` are computed together, kinds with a
        ``results_vector`` a whole kind at a time; metrics of other kinds, or with
        non-finite counts to report, go through ``kind.result``.
        """
        layout = self.layout
        values, present, slow = self._vector_results()
        keep = self.keep
        if slow is None and keep is None and present.all():  # the common step
            return dict(zip(layout.sorted_names, values[layout.name_order].tolist(), strict=True))
        if slow is None:
            slow = np.zeros(len(present), dtype=bool)
        elif keep is not None:
            slow &= keep
        if empty == "nan":
            values = np.where(present, values, math.nan)
            present = ~slow
        shown = present if keep is None else present & keep
        order = layout.name_order
        if not slow.any():
            shown = shown[order]
            names = compress(layout.sorted_names, shown)
            return dict(zip(names, values[order][shown].tolist(), strict=True))
        out: dict[str, float] = {}
        emitted = 0
        for i, is_slow, is_shown in zip(
            order.tolist(), slow[order].tolist(), shown[order].tolist(), strict=True
        ):
            name = layout.names[i]
            if is_slow:
                state = self._state(i, self.sums, self.maxes)
                part = results({name: state}, kind_of, empty=empty)
                out.update(part)
                emitted += len(part)
            elif is_shown:
                out[name] = float(values[i])
                emitted += 1
        if len(out) != emitted:
            results(self.states(), kind_of, empty=empty)  # raises, naming the clash
        return out

    def _vector_results(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(values, present, needs the slow path or None when no metric does) per slot.

        Values of metrics that are not present, or that need the slow path, are
        undefined."""
        layout = self.layout
        size = len(layout.slots)
        slow = layout.slow_rows.copy() if layout.has_slow_rows else None
        if self.counted:  # non-finite counts to report (rejected calls raised already)
            flagged = self.sums[layout.num_kind_sums :: NUM_FLAGS] > 0
            slow = flagged if slow is None else slow | flagged
        formulas = layout.formulas
        if formulas is not None:
            result, shown, slow = self._formula_results(slow)
            if formulas.rows is None:  # every metric: nothing else to fill in
                return result, shown, slow
        values = np.empty(size)
        present = np.zeros(size, dtype=bool)
        if formulas is not None:
            values[formulas.rows] = result
            present[formulas.rows] = shown
        for group in layout.vector_groups:
            kind, rows = group.kind, group.rows
            count = rows.stop - rows.start
            sums = self.sums[group.sums].reshape(count, kind.num_sums)
            maxes = self.maxes[group.maxes].reshape(count, kind.num_maxes)
            out = kind.results_vector(sums, maxes)
            if out is None:
                if slow is None:
                    slow = np.zeros(size, dtype=bool)
                slow[rows] = True
                continue
            values[rows], present[rows] = out
        return values, present, slow

    def _formula_results(
        self, slow: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(value, present) of every metric whose kind has a ``result_formula``, in the
        order of ``layout.formulas``, from a few array operations whatever the number of
        metrics and kinds; and ``slow`` with the rows added where a replicated value
        disagrees across ranks (those go through ``result``, which warns, naming them)."""
        f = self.layout.formulas
        state = np.concatenate((self.sums, self.maxes, _ONE))
        result = state[f.value]
        if f.negate is not None:
            np.negative(result, out=result, where=f.negate)
        if f.divisor is not None:
            with np.errstate(divide="ignore", invalid="ignore"):  # empty: not shown
                result /= state[f.divisor]
        shown = state[f.present] != 0
        if f.copy is not None:
            copies = result[f.copy_at]
            agree = (copies == -state[f.copy]) | np.isnan(copies)
            disagree = f.copy_at[shown[f.copy_at] & ~agree]
            if len(disagree):
                if slow is None:
                    slow = np.zeros(len(self.layout.slots), dtype=bool)
                slow[disagree if f.rows is None else f.rows[disagree]] = True
        return result, shown, slow

    def _state(self, i: int, sums: Sequence[float], maxes: Sequence[float]) -> MetricState:
        """Slot ``i``'s state read from ``sums`` and ``maxes`` (this step's buffers, as
        arrays or lists)."""
        layout, slot = self.layout, self.layout.slots[i]
        return MetricState(
            slot.kind.name,
            tuple(map(float, sums[layout.sum_slices[i]])),
            tuple(map(float, maxes[layout.max_slices[i]])),
            self.extras.get(slot.name),
            float(sums[slot.flag_offset]),
        )
