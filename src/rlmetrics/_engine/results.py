"""A merged step in packed form (``ReducedStep``), and its reported values.

Sync, the local path and ``TrackerState.compute`` all end in a ``ReducedStep``, so they
report the same bits. Each kind states its result once (``Kind.result_columns`` over its
block of the buffers); the values are reported sorted by metric name, a metric's
suffixed keys (``name/p50``) after it, empty metrics left out (or NaN), a non-finite
count where elements were skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from rlmetrics._engine.layout import BufferLayout
from rlmetrics.kinds.base import NUM_COUNTS, Kind, MetricState

Suffixed = dict[int, tuple[Kind, dict[str, float]]]  # name position -> (kind, values)


@dataclass(slots=True, eq=False)  # not frozen: a frozen __init__ sets each field the slow way
class ReducedStep:
    """One merged step in packed form, read within the call that built it (``sums`` and
    ``maxes`` may be views of buffers the next step reuses).

    Attributes:
        layout: where each metric's slots are.
        sums: the SUM part (the kinds' sums, then two framework counts per metric).
        maxes: the MAX part (the kinds' max slots and the extra-size slots).
        extras: each extra kind's merged extra, by name.
        keep: per placement, whether any rank logged the name this step (None: every one).
        nonfinite: per placement, the non-finite elements skipped (None: none anywhere).
    """

    layout: BufferLayout
    sums: np.ndarray
    maxes: np.ndarray
    extras: Mapping[str, object]
    keep: np.ndarray | None
    nonfinite: np.ndarray | None

    @classmethod
    def from_states(
        cls, states: Mapping[str, MetricState], kind_of: Callable[[str], Kind]
    ) -> ReducedStep:
        """States laid out in buffers as a sync leaves them (``TrackerState.compute``).

        Raises:
            ValueError: a state's slot counts are not its kind's.
        """
        layout = BufferLayout([(name, kind_of(metric.kind)) for name, metric in states.items()])
        sums, maxes = np.zeros(layout.num_sums), np.full(layout.num_maxes, -math.inf)
        for place in layout.placements:
            metric, kind = states[place.name], place.kind
            sums[place.sum_offset : place.sum_offset + kind.num_sums] = metric.sums
            maxes[place.max_offset : place.max_offset + kind.num_maxes] = metric.maxes
            sums[place.count_offset] = metric.num_nonfinite
        extras = {place.name: states[place.name].extra for place in layout.extra_placements}
        return cls(layout, sums, maxes, extras, None, nonfinite_counts(layout, sums))

    def states(self) -> dict[str, MetricState]:
        """Per metric, its merged state, by name (names no rank logged are left out)."""
        layout, keep = self.layout, self.keep
        sums, maxes = self.sums.tolist(), self.maxes.tolist()
        prints = {id(kind): kind.fingerprint() for kind in layout.kinds}
        states = {}
        for i, place in enumerate(layout.placements):
            if keep is not None and not keep[i]:
                continue
            kind = place.kind
            states[place.name] = MetricState(
                kind.name,
                tuple(sums[place.sum_offset : place.sum_offset + kind.num_sums]),
                tuple(maxes[place.max_offset : place.max_offset + kind.num_maxes]),
                self.extras.get(place.name),
                float(sums[place.count_offset]),
                prints[id(kind)],
            )
        return states

    def results(self, *, empty: str) -> dict[str, float]:
        """Every metric's values, as ``compute()`` reports them.

        Raises:
            ValueError: two metrics report the same key (``x`` as dist reports ``x/mean``).
        """
        layout, sums, maxes = self.layout, self.sums, self.maxes
        if not layout.groups:
            return {}
        values: list[np.ndarray] = []
        shown: list[np.ndarray] = []
        suffixed: Suffixed = {}
        for group in layout.groups:  # each kind's block of the buffers, as views
            kind, names = group.kind, group.names
            block = maxes[group.maxes].reshape(group.max_shape)
            extras = None
            if kind.has_extra:
                block = block[:, : kind.num_maxes]  # without the extra size
                extras = [self.extras[name] for name in names]
            out, present = kind.result_columns(
                sums[group.sums].reshape(group.sum_shape), block, extras, names
            )
            shown.append(present)
            column = out.get("") if len(out) == 1 else None
            if column is not None:
                values.append(column)
                continue
            values.append(np.zeros(len(names)))  # reported from ``suffixed``
            columns = {suffix: column.tolist() for suffix, column in out.items()}
            for i, name in enumerate(names):
                suffixed[layout.index[name]] = (kind, {s: c[i] for s, c in columns.items()})
        if len(values) == 1:  # one group holds every name, in order
            value, present = values[0], shown[0]
        else:
            value = np.concatenate(values)[layout.by_name]
            present = np.concatenate(shown)[layout.by_name]
        plain = not suffixed and self.nonfinite is None and self.keep is None
        if plain and np.count_nonzero(present) == len(present):
            result = layout.keys.copy()
            result.update(zip(layout.names, value.tolist(), strict=True))
            return result
        return _laid_out(layout.names, value, present, suffixed, self.nonfinite, self.keep, empty)


def nonfinite_counts(layout: BufferLayout, sums: np.ndarray) -> np.ndarray | None:
    """Per placement, the non-finite elements skipped, read from a SUM part; None when none."""
    counts = sums[layout.num_kind_sums :: NUM_COUNTS]
    return counts if np.count_nonzero(counts) else None


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
