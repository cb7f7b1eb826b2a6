"""A merged step in packed form (``Reduced``), and its reported values.

Sync and the local path both end in a ``Reduced``: the reduced SUM and MAX parts, read
through the layout. Each kind states its result once (``Kind.result_rows``, over all
its metrics' rows, or ``Kind.result`` per metric); ``Reduced.results`` hands each kind
its block of the buffers and lays the values out as ``compute()`` reports them: sorted
by metric name, a metric's suffixed keys (``name/p50``) after it, empty metrics left
out (or NaN), a non-finite count where elements were skipped. ``TrackerState.compute``
builds a ``Reduced`` from states, so both paths report the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from rlmetrics.kinds.base import NUM_FLAGS, Kind, MetricState
from rlmetrics.layout import KindGroup, Layout

Suffixed = dict[int, tuple[Kind, dict[str, float]]]  # name position -> (kind, values)


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

    @classmethod
    def from_states(
        cls, states: Mapping[str, MetricState], kind_of: Callable[[str], Kind]
    ) -> Reduced:
        """States laid out in buffers as a sync leaves them (``TrackerState.compute``).

        Raises:
            ValueError: a state's slot counts are not its kind's.
        """
        layout = Layout([(name, kind_of(metric.kind)) for name, metric in states.items()])
        sums, maxes = np.zeros(layout.num_sums), np.full(layout.num_maxes, -math.inf)
        for slot in layout.slots:
            metric, kind = states[slot.name], slot.kind
            sums[slot.sum_offset : slot.sum_offset + kind.num_sums] = metric.sums
            maxes[slot.max_offset : slot.max_offset + kind.num_maxes] = metric.maxes
            sums[slot.flag_offset] = metric.num_nonfinite
        extras = {slot.name: states[slot.name].extra for slot in layout.extra_slots}
        return cls(layout, sums, maxes, extras, None)

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
        """Every metric's values, as ``compute()`` reports them.

        Raises:
            ValueError: two metrics report the same key (``x`` as dist reports ``x/mean``).
        """
        layout = self.layout
        values: list[np.ndarray] = []
        shown: list[np.ndarray] = []
        suffixed: Suffixed = {}
        for group in layout.groups:
            out, present = self._group_results(group)
            shown.append(present)
            if len(out) == 1 and "" in out:
                values.append(out[""])
                continue
            values.append(np.zeros(len(group.names)))  # reported from ``suffixed``
            columns = {suffix: column.tolist() for suffix, column in out.items()}
            for i, name in enumerate(group.names):
                suffixed[layout.index[name]] = (group.kind, {s: c[i] for s, c in columns.items()})
        value, present = _by_name(values, layout), _by_name(shown, layout)
        nonfinite = self.sums[layout.num_kind_sums :: NUM_FLAGS]
        counted = np.count_nonzero(nonfinite) > 0
        common = not (suffixed or counted) and self.keep is None
        if common and np.count_nonzero(present) == len(present):
            return dict(zip(layout.names, value.tolist(), strict=True))
        return _laid_out(
            layout.names, value, present, suffixed, nonfinite if counted else None, self.keep, empty
        )

    def _group_results(self, group: KindGroup) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """One kind's ``result_rows`` over its block of the buffers (views)."""
        kind, names = group.kind, group.names
        sums = self.sums[group.sums].reshape(len(names), kind.num_sums)
        maxes = self.maxes[group.maxes].reshape(len(names), group.width)
        extras = None
        if kind.has_extra:
            maxes = maxes[:, : kind.num_maxes]  # without the extra size
            extras = [self.extras[name] for name in names]
        return kind.result_rows(sums, maxes, extras, names)


def _by_name(parts: list[np.ndarray], layout: Layout) -> np.ndarray:
    """Per-group arrays (in the groups' order) as one array in name order."""
    if len(parts) == 1:  # one group holds every name, in order
        return parts[0]
    return np.concatenate(parts)[layout.by_name] if parts else np.zeros(0)


def _laid_out(
    names: Sequence[str],
    values: np.ndarray,
    present: np.ndarray,
    suffixed: Suffixed,
    nonfinite: np.ndarray | None,
    keep: np.ndarray | None,
    empty: str,
) -> dict[str, float]:
    out: dict[str, float] = {}
    sources: dict[str, str] = {}
    shown = present.tolist()
    value_list = values.tolist()
    for row, name in enumerate(names):
        if keep is not None and not keep[row]:
            continue
        kind_values = suffixed.get(row)
        if shown[row]:
            metric = {"": value_list[row]} if kind_values is None else kind_values[1]
        elif empty == "nan":
            suffixes = ("",) if kind_values is None else kind_values[0].result_names()
            metric = dict.fromkeys(suffixes, math.nan)
        else:
            metric = {}
        if nonfinite is not None and nonfinite[row] > 0:
            metric = {**metric, "nonfinite_count": float(nonfinite[row])}
        for suffix, value in metric.items():
            key = f"{name}/{suffix}" if suffix else name
            if key in sources:
                raise ValueError(
                    f"metric {name!r} reports {key!r}, which metric {sources[key]!r} "
                    "reports too; rename one of them"
                )
            sources[key] = name
            out[key] = float(value)
    return out
