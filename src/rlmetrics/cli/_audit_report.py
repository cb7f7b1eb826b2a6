"""The audit's report: per metric, the spread of its value across partitions.

Shared by both modes of ``rlmetrics audit``: the reference trainer's step
(``rlmetrics.cli.audit``) and a user's function through the partition checker
(``--fn``). ``spread_report({partition label: metrics}, tol)`` builds an ``AuditReport``;
``render`` prints its table and verdict, ``plot`` draws it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FLOOR = 1e-18  # where the plot puts a spread of exactly 0


# -- spreads --------------------------------------------------------------------------
@dataclass(frozen=True)
class Spread:
    """How far a metric's partitions lie from the first one."""

    value: float  # the first partition's
    abs_diff: float  # max over partitions of |value - first|
    rel_diff: float  # abs_diff / |first| (0 when equal, inf when first is 0)
    worst: str  # the partition furthest away
    ok: bool  # abs_diff <= tol · max(1, |first|)
    worst_value: float = math.nan  # the value at ``worst`` (NaN when missing there)


@dataclass(frozen=True)
class AuditReport:
    """Per metric, the exact spread (and the naive one when asked), plus what was left out."""

    partitions: list[str]
    tol: float
    exact: dict[str, Spread]
    naive: dict[str, Spread] | None
    excluded: list[str]
    exclude: tuple[str, ...] = ()  # the name prefixes left out

    def order(self) -> list[str]:
        """Metric names by drift: exact drifts first, then naive spread, then exact spread."""
        naive = self.naive or {}

        def key(name: str) -> tuple:
            e, n = self.exact[name], naive.get(name)
            return (e.ok, -(n.rel_diff if n else 0.0), -e.rel_diff, name)

        return sorted(self.exact, key=key)

    @property
    def drifting(self) -> list[str]:
        """Metrics whose exact values differ by more than ``tol``."""
        return [name for name in self.order() if not self.exact[name].ok]


def spread(values: dict[str, float | None], tol: float) -> Spread:
    """The spread of one metric over partitions ({label: value, None when missing})."""
    labels = list(values)
    first = values[labels[0]]
    worst, abs_diff = labels[0], 0.0
    for label in labels[1:]:
        v = values[label]
        if first is None or v is None or math.isnan(first) != math.isnan(v):
            diff = math.inf
        else:
            diff = 0.0 if math.isnan(v) else abs(v - first)
        if diff > abs_diff:
            worst, abs_diff = label, diff
    ref = math.nan if first is None else first
    rel = 0.0 if abs_diff == 0 else abs_diff / abs(ref) if ref else math.inf
    ok = abs_diff <= tol * max(1.0, abs(ref)) if first is not None else False
    at_worst = values[worst]
    return Spread(ref, abs_diff, rel, worst, ok, math.nan if at_worst is None else at_worst)


def spread_report(
    runs: Mapping[str, Mapping[str, float]],
    tol: float,
    *,
    naive: Mapping[str, Mapping[str, float]] | None = None,
    exclude: Iterable[str] = (),
) -> AuditReport:
    """The report of {partition label: metrics}; the first partition is the reference.

    ``naive``: {partition label: metrics} of a naive reduction (the trainer audit's
    ``--naive``), each partition's spread from the exact reference value: the naive
    reduction can miss it even in the reference partition. ``exclude``: name prefixes
    left out of the comparison (listed as excluded).
    """
    if len(runs) < 2:
        raise ValueError(f"an audit needs at least two partitions, got {list(runs)}")
    prefixes = tuple(exclude)
    names = sorted({k for metrics in runs.values() for k in metrics})
    excluded = [n for n in names if prefixes and n.startswith(prefixes)]
    kept = [n for n in names if n not in excluded]
    exact = {n: spread({p: m.get(n) for p, m in runs.items()}, tol) for n in kept}
    naive_spreads = None
    if naive is not None:  # each partition's naive value against the exact reference
        first = runs[next(iter(runs))]
        naive_spreads = {
            n: spread({"exact": first.get(n), **{p: naive[p].get(n) for p in runs}}, tol)
            for n in kept
        }
    return AuditReport(list(runs), tol, exact, naive_spreads, excluded, prefixes)


# -- output ---------------------------------------------------------------------------
def verdict(report: AuditReport) -> str:
    """``N metrics invariant to TOL; M drift, across ...``, then a line with the naive
    count and one with the exclusions (each line under 100 columns for a few partitions)."""
    drift = len(report.drifting)
    lines = [
        f"{len(report.exact) - drift} metrics invariant to {report.tol:g}; {drift} drift "
        f"({len(report.partitions)} partitions: {', '.join(report.partitions)})"
    ]
    if report.naive is not None:
        naive_drift = sum(not s.ok for s in report.naive.values())
        lines.append(f"naive (verl-style) aggregation: {naive_drift} of {len(report.naive)} drift")
    if report.excluded:
        groups = [f"{p}*" for p in report.exclude if any(n.startswith(p) for n in report.excluded)]
        lines.append(
            f"excluded: {len(report.excluded)} measurements, not functions of the batch "
            f"(--include-measurements compares them):\n  {', '.join(groups)}"
        )
    return "\n".join(lines)


def _num(x: float) -> str:
    return f"{x:.3g}" if x else "0"


def _percent(x: float) -> str:
    """A relative difference as a signed percentage, short: +4.3%, -430%, +1.2e+05%."""
    if math.isnan(x) or math.isinf(x):
        return str(x)
    if abs(x) < 0.1:
        return f"{x:+.1g}%"
    if abs(x) < 10:
        return f"{x:+.2g}%"
    return f"{x:+.0f}%" if abs(x) < 1e5 else f"{x:+.1e}%"


def table_rows(report: AuditReport) -> tuple[list[str], list[list[tuple[str, str]]]]:
    """The table's header and rows, each cell (text, rich style), sorted by drift.

    ``value`` is the reference partition's, ``exact Δ`` the largest relative difference
    from it over the partitions (``ok`` within the tolerance, else ``DRIFT at`` the
    partition furthest away). With the naive reduction: ``naive`` is its value furthest
    from the exact one, ``naive Δ`` that difference in percent of the exact value, ``at``
    the partition it came from.
    """
    header = ["metric", "value", "exact Δ"]
    if report.naive is not None:
        header += ["naive", "naive Δ", "at"]
    rows = []
    for name in report.order():
        e = report.exact[name]
        exact = (
            (f"{_num(e.rel_diff)} ok", "")
            if e.ok
            else (f"{_num(e.rel_diff)} DRIFT at {e.worst}", "red")
        )
        row = [(name, ""), (f"{e.value:.6g}", ""), exact]
        if report.naive is not None:
            n = report.naive[name]
            if n.abs_diff == 0:
                row += [("same", ""), ("0", ""), ("", "")]
            else:
                signed = (n.worst_value - n.value) / abs(n.value) if n.value else math.inf
                style = "" if n.ok else "yellow"
                row += [
                    (f"{n.worst_value:.6g}", ""),
                    (_percent(100 * signed), style),
                    (n.worst, ""),
                ]
        rows.append(row)
    return header, rows


def render(report: AuditReport, console: Any = None) -> None:
    """Print the table, sorted by drift, and the verdict line; about 100 columns wide.

    A rich table when rich is installed (or ``console`` is given), plain text otherwise;
    metric names are shown literally either way.
    """
    from rlmetrics._optional import available
    from rlmetrics.loggers._text_table import format_table

    title = f"metric spread across partitions (vs {report.partitions[0]})"
    header, rows = table_rows(report)
    if console is None and not available("rich"):
        plain = [[text for text, _ in row] for row in rows]
        right = [i for i, col in enumerate(header) if col not in ("metric", "at")]
        print(format_table(title, header, plain, right=right))
        print(verdict(report))
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    if console is None:  # piped output: 100 columns
        console = Console(width=None if Console().is_terminal else 100)
    table = Table(
        title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True
    )
    for col in header:
        table.add_column(
            col,
            justify="left" if col in ("metric", "at") else "right",
            no_wrap=col != "metric",
            overflow="fold",
        )
    for row in rows:
        table.add_row(*(Text(text, style=style) for text, style in row))
    console.print(table)
    console.print(verdict(report), soft_wrap=False, highlight=False, markup=False)


def plot(report: AuditReport, path: str | Path) -> Path:
    """A horizontal bar per metric: log10 of its relative spread (exact and naive)."""
    from matplotlib.figure import Figure

    names = report.order()[::-1]  # the most drifting at the top
    series = [("exact", report.exact, "tab:blue")]
    if report.naive is not None:
        series.append(("naive (verl-style)", report.naive, "tab:orange"))
    height = 0.8 / len(series)
    fig = Figure(figsize=(9, 1.6 + 0.26 * len(names) * len(series) ** 0.5), layout="constrained")
    ax = fig.subplots()
    floor = math.log10(FLOOR)
    for i, (label, spreads, color) in enumerate(series):
        logs = [min(math.log10(max(spreads[n].rel_diff, FLOOR)), 3.0) for n in names]
        ys = [y + (i - (len(series) - 1) / 2) * height for y in range(len(names))]
        ax.barh(ys, [v - floor for v in logs], left=floor, height=height, color=color, label=label)
    ax.axvline(
        math.log10(report.tol), color="tab:red", linestyle="--", label=f"tolerance {report.tol:g}"
    )
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xlim(floor, 3.0)
    ax.set_xlabel(f"log10 relative spread across partitions (0 drawn at {floor:.0f}; inf at 3)")
    title = ", ".join(report.partitions)
    if len(title) > 110:  # the checker's many runs: count them
        title = f"{len(report.partitions)} partitions (vs {report.partitions[0]})"
    ax.set_title(f"rlmetrics audit: {title}", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.savefig(path, dpi=120)
    return Path(path)
