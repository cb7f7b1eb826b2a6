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

SCALAR_LIMIT = 512
"""Steps whose reduced buffers hold at most this many floats compute their results in
python (when every metric's kind has a ``ResultFormula``): below about that size,
numpy's per-call cost is more than the arithmetic."""


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
        scalars: ``sums`` and ``maxes`` as python lists, when the caller has them.
    """

    layout: Layout
    sums: np.ndarray
    maxes: np.ndarray
    extras: Mapping[str, object]
    keep: np.ndarray | None
    counted: bool = True
    scalars: tuple[list[float], list[float]] | None = None

    def states(self) -> dict[str, MetricState]:
        """Per metric, its merged state, by name (names no rank logged are left out)."""
        layout, keep = self.layout, self.keep
        sums, maxes = self.sums.tolist(), self.maxes.tolist()
        prints: dict[int, str] = {}  # one fingerprint per kind object, not per metric
        for slot in layout.slots:
            if id(slot.kind) not in prints:
                prints[id(slot.kind)] = slot.kind.fingerprint()
        return {
            layout.names[i]: self._state(i, sums, maxes, prints[id(layout.slots[i].kind)])
            for i in range(len(layout.slots))
            if keep is None or keep[i]
        }

    def results(self, kind_of: Callable[[str], Kind], *, empty: str) -> dict[str, float]:
        """Every metric's values, as ``state.results`` gives them, sorted by name.

        Kinds with a ``result_formula`` are computed together, kinds with a
        ``results_vector`` a whole kind at a time; metrics of other kinds, or with
        non-finite counts to report, go through ``kind.result``.
        """
        layout = self.layout
        if self.keep is None and not self.counted and python_results(layout):
            sums, maxes = self.scalars or (self.sums.tolist(), self.maxes.tolist())
            out = scalar_results(layout, sums + maxes, empty)
            if out is not None:
                return out
        values, present, slow = self._vector_results()
        keep = self.keep
        if slow is None and keep is None and present.all():  # the common step
            return dict(zip(layout.names, values.tolist(), strict=True))
        if slow is None:
            slow = np.zeros(len(present), dtype=bool)
        elif keep is not None:
            slow &= keep
        if empty == "nan":
            values = np.where(present, values, math.nan)
            present = ~slow
        shown = present if keep is None else present & keep
        if not slow.any():
            names = compress(layout.names, shown)
            return dict(zip(names, values[shown].tolist(), strict=True))
        out: dict[str, float] = {}
        emitted = 0
        for i, (name, is_slow, is_shown) in enumerate(
            zip(layout.names, slow.tolist(), shown.tolist(), strict=True)
        ):
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
            rows = group.rows
            out = group.kind.results_vector(self.sums[group.sums], self.maxes[group.maxes])
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

    def _state(
        self, i: int, sums: Sequence[float], maxes: Sequence[float], fingerprint: str = ""
    ) -> MetricState:
        """Slot ``i``'s state read from ``sums`` and ``maxes`` (this step's buffers, as
        arrays or lists), made by a kind of ``fingerprint``."""
        layout, slot = self.layout, self.layout.slots[i]
        return MetricState(
            slot.kind.name,
            tuple(map(float, sums[layout.sum_slices[i]])),
            tuple(map(float, maxes[layout.max_slices[i]])),
            self.extras.get(slot.name),
            float(sums[slot.flag_offset]),
            fingerprint,
        )


def python_results(layout: Layout) -> bool:
    """Whether a step of ``layout`` computes its results in python: every metric's kind
    has a formula and the reduced buffers hold at most ``SCALAR_LIMIT`` floats."""
    return layout.scalar_formulas is not None and layout.num_sums + layout.num_maxes <= SCALAR_LIMIT


def scalar_results(layout: Layout, state: list[float], empty: str) -> dict[str, float] | None:
    """Every metric's formula result, in python, from the buffers read as one list
    ``[*sums, *maxes]``: the same IEEE arithmetic as the array path, bit for bit. None
    when a replicated value disagrees across ranks (the caller takes the path that
    warns, naming it)."""
    out: dict[str, float] = {}
    nan_for_empty = empty == "nan"
    for name, value, present, divisor, negate, copy in layout.scalar_formulas:
        if not state[present]:
            if nan_for_empty:
                out[name] = math.nan
            continue
        result = -state[value] if negate else state[value]
        if divisor is not None:
            result = _divide(result, state[divisor])
        if copy is not None and result != -state[copy] and result == result:
            return None
        out[name] = result
    return out


def _divide(a: float, b: float) -> float:
    """``a / b`` as IEEE (and numpy) divide: by zero gives ±inf, or NaN for 0 or NaN."""
    try:
        return a / b
    except ZeroDivisionError:
        if a == 0 or a != a:
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)
