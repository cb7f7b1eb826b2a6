"""Plot a JSONL metrics file: one subplot per metric against step (matplotlib, Agg).

From the command line: ``rlmetrics plot RUN.jsonl --metrics a,b --by x,y --out fig.png``.

Metrics are drawn in pages of at most ``PAGE_SIZE`` subplots, one page per prefix group
(``actor/...``, ``critic/...``; a large group takes several pages, titled ``group 1/2``,
``group 2/2``). One page goes to ``out``; several pages go to one multi-page file when
``out`` is a PDF, else to one file per page, ``<out stem>-<NN>-<page><suffix>``. Each
page is as tall as its subplots need; pages of one shape share one reused figure with
fixed margins (no layout solver, no shared axes), so the time grows linearly with the
number of metrics; one figure of hundreds of shared-axis, constrained-layout subplots
grows much faster. A rank index (``*/slowest_rank``) is drawn as points, not a line.

A metric matplotlib cannot draw as it is costs only itself (``panel``): values beyond
±1e300 (a diverging grad norm near ±1.7e308 makes the axis span overflow) are drawn
divided by a power of ten, named in the subplot's title; infinite values are gaps, as
nulls are; a metric with no finite value keeps its subplot with a note saying why.
Each such metric gets one ``PlotWarning`` naming it. Only when no selected metric can
be drawn at all does the plot fail (``ValueError``), writing nothing.

``by`` (``--by short,long``) draws per-group curves: a metric's ``<name>/<label>`` keys
(the tracker's ``by=`` groups, such as a trainer's per data source ones) go on the
metric's own subplot, one line per label beside the whole batch's ("all"), with a legend.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import re
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlmetrics._optional import require
from rlmetrics.loggers.jsonl import parse_row

PAGE_SIZE = 24  # subplots per page
COLUMNS = 3  # subplots per row on a page of more than SINGLE_COLUMN metrics
SINGLE_COLUMN = 4
PANEL_INCHES = (4.2, 2.0)  # one subplot's cell (width, height)
MARGINS = {"left": 0.75, "right": 0.2, "top": 0.8, "bottom": 0.5}  # inches
TITLE_FROM_TOP = 0.12  # inches from the figure's top edge to the page title's top
DISCRETE = ("/slowest_rank",)  # name endings of integer metrics: points, integer ticks
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
AXIS_LIMIT = 1e300  # beyond this magnitude an axis' span and margins can overflow a float

Series = dict[str, tuple[list[int], list[float]]]


class PlotWarning(UserWarning):
    """Lines of a metrics file were skipped, or a metric is not drawn as it is."""


def read_jsonl(path: str | os.PathLike) -> Series:
    """Each metric's (steps, values) from a JSONL metrics file; null reads as NaN.

    A line is skipped (with one ``PlotWarning`` counting them) when it is not a JSON
    object with an integer ``step`` (``true`` is not a step), when it is nested too
    deeply to parse, or when a number in it is beyond the float range; a torn last line
    is one such line. Values that are not numbers (strings, lists, objects, booleans)
    are left out of the plot.
    """
    series: Series = {}
    skipped = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            parsed = parse_row(line)
            if parsed is None:
                skipped += 1
                continue
            step, values = parsed
            for name, value in values.items():
                steps, ys = series.setdefault(name, ([], []))
                steps.append(step)
                ys.append(value)
    if skipped:
        warnings.warn(
            f"{os.fspath(path)}: skipped {skipped} line(s) that are not a JSON object with an "
            "integer step and numeric values",
            PlotWarning,
            stacklevel=2,
        )
    return series


@dataclass
class Curve:
    """One line of a subplot: its label in the legend ("" with a single line), points
    and colour."""

    label: str
    steps: list[float]
    values: list[float]
    color: str = "C0"


@dataclass
class Panel:
    """One metric as drawn: its lines, its title, and what the reader must know."""

    curves: list[Curve]
    title: str
    notes: list[str] = field(default_factory=list)  # why it is not drawn as it is
    drawn: bool = True  # False: no finite value, the subplot holds only its note
    discrete: bool = False  # an index (a rank): points without a line, integer ticks

    @property
    def steps(self) -> list[float]:
        """The first line's steps."""
        return self.curves[0].steps

    @property
    def values(self) -> list[float]:
        """The first line's values (as drawn: scaled when the title says so)."""
        return self.curves[0].values


def panel(name: str, steps: Sequence[int], values: Sequence[float]) -> Panel:
    """``name``'s points in a form matplotlib can draw.

    Infinite values become gaps (as nulls are). Points at steps beyond ±1e300 are left
    out (the x axis could not span them). Values beyond ±1e300 are divided by
    ``10**e`` (e: the exponent of the largest), the title says ``(×1e<e>)``; it also
    counts the infinite values (``[2 inf]``). With no finite value left, the panel is
    not drawn.
    """
    return grouped_panel(name, [("", steps, values)])


def grouped_panel(name: str, lines: Sequence[tuple[str, Sequence[int], Sequence[float]]]) -> Panel:
    """``panel`` of several labelled lines on one subplot (``(label, steps, values)``):
    one scale for all, the notes counting over all."""
    curves = []
    far = infinite = total = 0
    for label, steps, values in lines:
        xs: list[float] = []
        ys: list[float] = []
        total += len(values)
        for step, value in zip(steps, values, strict=True):
            try:
                x = float(step)
            except OverflowError:
                x = math.inf
            if not abs(x) <= AXIS_LIMIT:
                far += 1
                continue
            if math.isinf(value):
                infinite += 1
                value = math.nan
            xs.append(x)
            ys.append(value)
        curves.append(Curve(label, xs, ys))
    notes = []
    title = name
    if infinite:
        notes.append(f"{infinite} infinite value(s) drawn as gaps")
        title = f"{title} [{infinite} inf]"
    if far:
        notes.append(f"{far} point(s) at steps beyond ±{AXIS_LIMIT:g} left out")
    finite = [abs(v) for c in curves for v in c.values if math.isfinite(v)]
    if not finite:
        notes.insert(0, f"not drawn: no finite value in {total} point(s)")
        return Panel(curves, title, notes, drawn=False)
    peak = max(finite)
    if peak > AXIS_LIMIT:
        exponent = math.floor(math.log10(peak))
        scale = 10.0**exponent
        for c in curves:
            c.values = [v / scale for v in c.values]
        title = f"{title} (×1e{exponent})"
        notes.append(f"values reach {peak:.3g}: drawn divided by 1e{exponent}")
    return Panel(curves, title, notes)


def pages(names: Sequence[str], size: int = PAGE_SIZE) -> list[tuple[str, list[str]]]:
    """``names`` cut into pages of at most ``size``: (page label, names) in order.

    All names fit on one page: one page, labelled "". Otherwise one page per prefix
    group (the part before the first "/"; "other" for names without one), a group
    larger than ``size`` split into consecutive pages labelled ``group 1/N``, ...,
    ``group N/N``, so no two pages share a label. The order of ``names`` is kept.
    """
    if len(names) <= size:
        return [("", list(names))]
    out = []
    groups: dict[str, list[str]] = {}
    for name in names:
        head, sep, _ = name.partition("/")
        groups.setdefault(head if sep else "other", []).append(name)
    for group, members in groups.items():
        parts = math.ceil(len(members) / size)
        for part, start in enumerate(range(0, len(members), size), start=1):
            label = f"{group} {part}/{parts}" if parts > 1 else group
            out.append((label, members[start : start + size]))
    return out


def page_paths(out: Path, page_groups: Sequence[str]) -> list[Path]:
    """One file per page: ``out`` itself for one page, else ``<stem>-<NN>-<group><suffix>``."""
    if len(page_groups) == 1:
        return [out]
    return [
        out.with_name(f"{out.stem}-{i:02d}-{_UNSAFE.sub('_', group).strip('_')}{out.suffix}")
        for i, group in enumerate(page_groups, start=1)
    ]


def grid(count: int) -> tuple[int, int]:
    """(rows, columns) of a page of ``count`` subplots."""
    cols = 1 if count <= SINGLE_COLUMN else COLUMNS
    return math.ceil(count / cols), cols


class PageFigure:
    """One figure with one grid of subplots, reused for every page of a plot.

    Creating subplots costs more than drawing them, so each page only changes the
    lines' data, the titles and the limits, and hides the cells it does not use.
    Titles and axis labels sit at fixed positions (matplotlib's automatic placement
    measures every tick label of the neighbouring subplots on each draw).
    """

    def __init__(self, rows: int, cols: int) -> None:
        from matplotlib.figure import Figure

        width = MARGINS["left"] + MARGINS["right"] + cols * PANEL_INCHES[0]
        height = MARGINS["top"] + MARGINS["bottom"] + rows * PANEL_INCHES[1]
        self.fig = Figure(figsize=(width, height))
        self.fig.subplots_adjust(
            left=MARGINS["left"] / width,
            right=1 - MARGINS["right"] / width,
            bottom=MARGINS["bottom"] / height,
            top=1 - MARGINS["top"] / height,
            hspace=0.45,
            wspace=0.3,
        )
        self.cols = cols
        self.axes = list(self.fig.subplots(rows, cols, squeeze=False).ravel())
        self.lines = [[ax.plot([], [], linewidth=1.2)[0]] for ax in self.axes]
        for ax in self.axes:
            ax.grid(True, alpha=0.3)
            ax.locator_params(nbins=5)
            ax.xaxis.set_label_coords(0.5, -0.16)
        self.notes = [
            ax.text(
                0.5,
                0.5,
                "",
                transform=ax.transAxes,
                ha="center",
                va="center",
                fontsize=8,
                color="tab:red",
                wrap=True,
            )
            for ax in self.axes
        ]
        # at a fixed distance from the top edge, above the first row's titles
        self.title = self.fig.suptitle(
            "", x=0.01, y=1 - TITLE_FROM_TOP / height, ha="left", va="top", fontsize=11
        )

    def draw(self, panels: Sequence[Panel], title: str) -> None:
        """Show ``panels`` in the first cells, hide the rest. Every cell gets the same x
        limits, so only the bottom cell of each column labels its x ticks. A panel not
        drawn keeps its cell, with its note in place of the line."""
        from matplotlib.ticker import MaxNLocator

        all_steps = list(itertools.chain.from_iterable(p.steps for p in panels))
        lo, hi = (min(all_steps), max(all_steps)) if all_steps else (0.0, 1.0)
        last_row = {i % self.cols: i for i in range(len(panels))}  # bottom cell per column
        cells = zip(self.axes, self.lines, self.notes, strict=True)
        for i, (ax, line, note) in enumerate(cells):
            ax.set_visible(i < len(panels))
            if i >= len(panels):
                continue
            p = panels[i]
            self._draw_curves(ax, line, p)
            note.set_text("" if p.drawn else "\n".join(p.notes))
            ax.set_title(p.title, loc="left", fontsize=9, y=1.0, pad=3)
            ax.tick_params(axis="y", labelleft=p.drawn)
            ax.yaxis.set_major_locator(MaxNLocator(nbins=5, integer=p.discrete))
            ax.relim()
            if p.drawn:
                ax.autoscale_view(scalex=False)
            else:
                ax.set_ylim(0.0, 1.0)
            ax.set_xlim(lo - 0.5, hi + 0.5) if lo == hi else ax.set_xlim(lo, hi)
            bottom = last_row[i % self.cols] == i  # x ticks are equal down a column
            ax.tick_params(axis="x", labelbottom=bottom)
            ax.set_xlabel("step" if bottom else "")
        self.title.set_text(title)

    @staticmethod
    def _draw_curves(ax: Any, lines: list[Any], p: Panel) -> None:
        """The panel's curves on the cell's lines (made as needed, the spare ones
        emptied), each in its colour; a legend when the curves are labelled."""
        while len(lines) < len(p.curves):
            lines.append(ax.plot([], [], linewidth=1.2)[0])
        labelled = any(curve.label for curve in p.curves)
        for j, line in enumerate(lines):
            curve = p.curves[j] if j < len(p.curves) and p.drawn else None
            line.set_data(curve.steps, curve.values) if curve else line.set_data([], [])
            if curve is not None:
                line.set_marker("." if len(curve.steps) < 50 or p.discrete else "None")
                line.set_linestyle("None" if p.discrete else "-")
                line.set_label(curve.label or "_")
                line.set_color(curve.color)
        legend = ax.get_legend()
        if legend is not None:
            legend.remove()
        if labelled and p.drawn:
            ax.legend(handles=lines[: len(p.curves)], fontsize=7, loc="best", frameon=False)


def plot_jsonl(
    path: str | os.PathLike,
    metrics: Sequence[str] | None = None,
    out: str | os.PathLike = "",
    by: Sequence[str] | None = None,
) -> list[Path]:
    """Plot metrics of a JSONL file; returns the files written.

    Args:
        path: the JSONL file (``{"step": n, "<name>": value, ...}`` per line).
        metrics: the names to plot, in order; None plots every metric, sorted.
        out: the image file (its suffix picks the format); "" means ``path`` with .png.
            Several pages go to one PDF (a ``.pdf`` out) or to one file per page.
        by: group labels (``["short", "long"]``): each metric's ``<name>/<label>`` keys
            are drawn on its subplot, one line per label in the file beside the
            metric's own ("all"), in the colours of the order given, with a legend; a
            metric may then exist only through its labels. Without ``metrics`` the
            ``<name>/<label>`` keys get no subplot of their own.

    A metric that cannot be drawn as it is (see ``panel``: huge or infinite values, no
    finite value) costs only itself and is named in a ``PlotWarning``.

    Raises:
        ValueError: a requested metric is not in the file, the file has none, or none of
            the selected metrics has a finite value to draw (nothing is written).
        ImportError: matplotlib is missing (``pip install 'rlmetrics[plot]'``).
    """
    require("matplotlib", "plot", "plotting")
    series = read_jsonl(path)
    labels = list(dict.fromkeys(by or ()))
    names = select(series, metrics, path, labels)
    panels = {name: metric_panel(series, name, labels) for name in names}
    if not any(p.drawn for p in panels.values()):
        reasons = "; ".join(f"{n!r}: {', '.join(p.notes)}" for n, p in panels.items())
        raise ValueError(f"nothing to draw in {os.fspath(path)!r}: {reasons}")
    for name, p in panels.items():
        if p.notes:
            warnings.warn(f"metric {name!r}: {'; '.join(p.notes)}", PlotWarning, stacklevel=2)
    out_path = Path(out) if out else Path(path).with_suffix(".png")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    layout = pages(names)
    figures: dict[tuple[int, int], PageFigure] = {}  # one per page shape, reused

    def drawn(label: str, members: list[str]) -> Any:
        shape = grid(len(members))
        page = figures.get(shape) or figures.setdefault(shape, PageFigure(*shape))
        page.draw([panels[n] for n in members], label)
        return page.fig

    if len(layout) > 1 and out_path.suffix.lower() == ".pdf":
        from matplotlib.backends.backend_pdf import PdfPages

        with PdfPages(out_path) as pdf:
            for label, members in layout:
                pdf.savefig(drawn(label, members))
        return [out_path]
    paths = page_paths(out_path, [label for label, _ in layout])
    for (label, members), target in zip(layout, paths, strict=True):
        drawn(label, members).savefig(target, dpi=100)
    return paths


def select(
    series: Series, metrics: Sequence[str] | None, path: Any, by: Sequence[str] = ()
) -> list[str]:
    """The metric names to plot, checked against the file's (with ``by``, a name whose
    ``<name>/<label>`` keys are in the file counts as there, and without ``metrics``
    those keys are drawn on their metric's subplot, not on their own)."""
    grouped = {f"/{label}" for label in by}
    if metrics is None:
        names = sorted({_base(name, grouped) for name in series})
    else:
        names = list(metrics)
        missing = [n for n in names if n not in series and not _labelled(series, n, by)]
        if missing:
            raise ValueError(
                f"metrics {missing} are not in {os.fspath(path)!r}; it has: "
                f"{', '.join(sorted(series)) or 'none'}"
            )
    if not names:
        raise ValueError(f"{os.fspath(path)!r} holds no metrics to plot")
    return names


def _base(name: str, grouped: set[str]) -> str:
    """``name`` less a ``/<label>`` ending of ``grouped``, else ``name``."""
    head, sep, tail = name.rpartition("/")
    return head if sep and head and f"/{tail}" in grouped else name


def _labelled(series: Series, name: str, by: Sequence[str]) -> list[str]:
    """The labels of ``by`` whose ``<name>/<label>`` key is in ``series``."""
    return [label for label in by if f"{name}/{label}" in series]


ALL = "all"  # the legend entry of a metric's own (whole-batch) line among its labels'


def metric_panel(series: Series, name: str, by: Sequence[str] = ()) -> Panel:
    """``name``'s subplot: its own line, and with ``by`` one line per label in the file
    (colour ``C<i>`` for the i-th label of ``by``; the metric's own line black)."""
    labels = _labelled(series, name, by)
    if not labels:
        single = panel(name, *series[name])
        single.discrete = name.endswith(DISCRETE)
        return single
    lines = [(ALL, *series[name])] if name in series else []
    lines += [(label, *series[f"{name}/{label}"]) for label in labels]
    grouped = grouped_panel(name, lines)
    for curve in grouped.curves:
        curve.color = "black" if curve.label == ALL else f"C{list(by).index(curve.label)}"
    return grouped


def split_names(text: str | None) -> list[str] | None:
    """``"a,b"`` as ["a", "b"]; None or "" as None (all metrics)."""
    if not text:
        return None
    return [name.strip() for name in text.split(",") if name.strip()]


EXIT_STATUS = (
    "A metric that cannot be drawn as it is (values beyond ±1e300 are drawn divided by a "
    "power of ten, infinities are gaps, a metric with no finite value keeps an empty "
    "subplot with a note) is named on stderr. Exit status: 0 when the figure is written, "
    "2 on an error, also when no selected metric has a finite value to draw."
)


def add_plot_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``RUN.jsonl --metrics a,b --out fig.png`` to a (sub)parser, and the exit
    status to its help."""
    parser.epilog = EXIT_STATUS
    parser.add_argument("run", help="the JSONL metrics file (one object per step)")
    parser.add_argument(
        "--metrics", default=None, help="comma-separated metric names (default: all)"
    )
    parser.add_argument(
        "--by",
        default=None,
        metavar="LABELS",
        help="comma-separated group labels (e.g. short,long): each metric's <name>/<label> "
        "keys (per data source, by= groups) drawn on its subplot, one line per label",
    )
    parser.add_argument(
        "--out",
        default="",
        help=f"the image file (default: RUN with .png); more than {PAGE_SIZE} metrics go "
        "to one page per prefix group: one multi-page .pdf, or one file per page",
    )
    return parser


def run_plot(args: argparse.Namespace) -> int:
    """Plot from parsed arguments; returns the exit status: 0 when a file was written
    (each metric not drawn as it is named on stderr), 2 with a message on error (also
    when no selected metric has a finite value to draw)."""
    caught: list[warnings.WarningMessage] = []
    try:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", PlotWarning)
                written = plot_jsonl(
                    args.run, split_names(args.metrics), args.out, split_names(args.by)
                )
        finally:  # shown once recording has stopped: inside, each shown warning was
            _show(caught)  # recorded again into the list being shown, without end
    except (OSError, ValueError, ImportError) as err:
        print(f"rlmetrics plot: error: {err}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(p) for p in _shorten(written)))
    return 0


def _show(caught: list[warnings.WarningMessage]) -> None:
    """PlotWarnings as ``rlmetrics plot: warning: ...`` lines, other warnings as usual."""
    for w in caught:
        if issubclass(w.category, PlotWarning):
            print(f"rlmetrics plot: warning: {w.message}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)


def _shorten(paths: list[Path]) -> Iterator[str]:
    """The paths written, at most 4 named and the rest counted."""
    yield from (str(p) for p in paths[:4])
    if len(paths) > 4:
        yield f"... ({len(paths)} files)"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rlmetrics.plot RUN.jsonl [--metrics a,b] [--by x,y] [--out fig.png]``."""
    parser = add_plot_arguments(
        argparse.ArgumentParser(prog="rlmetrics plot", description=__doc__.splitlines()[0])
    )
    return run_plot(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
