"""A step's reported values: every metric's result, a whole kind at a time.

Each kind states its result once (``Kind.result_rows``, vectorised over its metrics, or
``Kind.result`` per metric); this module asks each kind for its metrics' values and
lays them out as ``compute()`` reports them: sorted by metric name, a metric's suffixed
keys (``name/p50``) after it, empty metrics left out (or NaN), a non-finite count where
elements were skipped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlmetrics.kinds.base import Kind


@dataclass(frozen=True, slots=True)
class KindRows:
    """The metrics of one kind in a step: their positions among the step's (sorted)
    names, and their merged state as rows."""

    kind: Kind
    rows: np.ndarray  # int64 positions in the names
    sums: np.ndarray  # (len(rows), num_sums)
    maxes: np.ndarray  # (len(rows), num_maxes)
    extras: Sequence[Any] | None  # per row, for kinds with an extra


def results(
    names: Sequence[str],
    groups: Sequence[KindRows],
    *,
    nonfinite: np.ndarray | None = None,
    keep: np.ndarray | None = None,
    empty: str = "omit",
) -> dict[str, float]:
    """Every metric's values, in ``names`` order (sorted by the caller).

    Args:
        names: the metrics, sorted.
        groups: every metric's state, kind by kind.
        nonfinite: per metric, the non-finite elements skipped (None: none).
        keep: per metric, whether to report it (None: all).
        empty: "omit" leaves empty metrics out, "nan" reports NaN for each key.

    Raises:
        ValueError: two metrics report the same key (``x`` as dist reports ``x/mean``).
    """
    size = len(names)
    values = np.empty(size)
    present = np.zeros(size, dtype=bool)
    suffixed: dict[int, tuple[Kind, dict[str, float]]] = {}
    for group in groups:
        group_names = [names[i] for i in group.rows.tolist()]
        out, shown = group.kind.result_rows(group.sums, group.maxes, group.extras, group_names)
        present[group.rows] = shown
        if list(out) == [""]:
            values[group.rows] = out[""]
            continue
        columns = {suffix: column.tolist() for suffix, column in out.items()}
        for i, row in enumerate(group.rows.tolist()):
            suffixed[row] = (group.kind, {s: c[i] for s, c in columns.items()})
    counted = nonfinite is not None and bool(nonfinite.any())
    if not suffixed and not counted and keep is None and present.all():  # the common step
        return dict(zip(names, values.tolist(), strict=True))
    return _laid_out(names, values, present, suffixed, nonfinite if counted else None, keep, empty)


def _laid_out(
    names: Sequence[str],
    values: np.ndarray,
    present: np.ndarray,
    suffixed: dict[int, tuple[Kind, dict[str, float]]],
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
