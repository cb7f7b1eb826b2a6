"""Plot a JSONL metrics file: one subplot per metric against step (matplotlib, Agg).

From the command line: ``rlmetrics plot RUN.jsonl --metrics a,b --out fig.png``.

Metrics are drawn in pages of at most ``PAGE_SIZE`` subplots, one page per prefix group
(``actor/...``, ``critic/...``; a large group takes several pages). One page goes to
``out``; several pages go to one multi-page file when ``out`` is a PDF, else to one
file per page, ``<out stem>-<NN>-<group><suffix>``. Every page has the same bounded
number of subplots, drawn on one reused figure with fixed margins (no layout solver,
no shared axes), so the time grows linearly with the number of metrics; one figure of
hundreds of shared-axis, constrained-layout subplots grows much faster.
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
from pathlib import Path
from typing import Any

from rlmetrics.extras import require
from rlmetrics.loggers.jsonl import parse_row

PAGE_SIZE = 24  # subplots per page
COLUMNS = 3  # subplots per row on a page of more than SINGLE_COLUMN metrics
SINGLE_COLUMN = 4
PANEL_INCHES = (4.2, 2.0)  # one subplot's cell (width, height)
MARGINS = {"left": 0.75, "right": 0.2, "top": 0.55, "bottom": 0.5}  # inches
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")

Series = dict[str, tuple[list[int], list[float]]]


class PlotWarning(UserWarning):
    """Lines of a metrics file were skipped."""


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


def pages(names: Sequence[str], size: int = PAGE_SIZE) -> list[tuple[str, list[str]]]:
    """``names`` cut into pages of at most ``size``: (group, names) in order.

    All names fit on one page: one page, labelled "". Otherwise one page per prefix
    group (the part before the first "/"; "other" for names without one), a group
    larger than ``size`` split into consecutive pages. The order of ``names`` is kept.
    """
    if len(names) <= size:
        return [("", list(names))]
    out = []
    groups: dict[str, list[str]] = {}
    for name in names:
        head, sep, _ = name.partition("/")
        groups.setdefault(head if sep else "other", []).append(name)
    for group, members in groups.items():
        for start in range(0, len(members), size):
            out.append((group, members[start : start + size]))
    return out


def page_paths(out: Path, page_groups: Sequence[str]) -> list[Path]:
    """One file per page: ``out`` itself for one page, else ``<stem>-<NN>-<group><suffix>``."""
    if len(page_groups) == 1:
        return [out]
    return [
        out.with_name(f"{out.stem}-{i:02d}-{_UNSAFE.sub('_', group)}{out.suffix}")
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
            left=MARGINS["left"] / width, right=1 - MARGINS["right"] / width,
            bottom=MARGINS["bottom"] / height, top=1 - MARGINS["top"] / height,
            hspace=0.45, wspace=0.3,
        )  # fmt: skip
        self.cols = cols
        self.axes = list(self.fig.subplots(rows, cols, squeeze=False).ravel())
        self.lines = [ax.plot([], [], linewidth=1.2)[0] for ax in self.axes]
        for ax in self.axes:
            ax.grid(True, alpha=0.3)
            ax.locator_params(nbins=5)
            ax.xaxis.set_label_coords(0.5, -0.16)
        self.title = self.fig.suptitle("", x=0.01, ha="left", fontsize=11)

    def draw(self, series: Series, names: Sequence[str], title: str) -> None:
        """Show ``names`` in the first cells, hide the rest. Every cell gets the same x
        limits, so only the bottom cell of each column labels its x ticks."""
        all_steps = list(itertools.chain.from_iterable(series[n][0] for n in names))
        lo, hi = min(all_steps), max(all_steps)
        last_row = {i % self.cols: i for i in range(len(names))}  # bottom cell per column
        for i, (ax, line) in enumerate(zip(self.axes, self.lines, strict=True)):
            ax.set_visible(i < len(names))
            if i >= len(names):
                continue
            steps, values = series[names[i]]
            line.set_data(steps, values)
            line.set_marker("." if len(steps) < 50 else "None")
            ax.set_title(names[i], loc="left", fontsize=9, y=1.0, pad=3)
            ax.relim()
            ax.autoscale_view(scalex=False)
            ax.set_xlim(lo - 0.5, hi + 0.5) if lo == hi else ax.set_xlim(lo, hi)
            bottom = last_row[i % self.cols] == i  # x ticks are equal down a column
            ax.tick_params(axis="x", labelbottom=bottom)
            ax.set_xlabel("step" if bottom else "")
        self.title.set_text(title)


def plot_jsonl(
    path: str | os.PathLike, metrics: Sequence[str] | None = None, out: str | os.PathLike = ""
) -> list[Path]:
    """Plot metrics of a JSONL file; returns the files written.

    Args:
        path: the JSONL file (``{"step": n, "<name>": value, ...}`` per line).
        metrics: the names to plot, in order; None plots every metric, sorted.
        out: the image file (its suffix picks the format); "" means ``path`` with .png.
            Several pages go to one PDF (a ``.pdf`` out) or to one file per page.

    Raises:
        ValueError: a requested metric is not in the file, or the file has none.
        ImportError: matplotlib is missing (``pip install 'rlmetrics[plot]'``).
    """
    require("matplotlib", "plot", "plotting")
    series = read_jsonl(path)
    names = select(series, metrics, path)
    out_path = Path(out) if out else Path(path).with_suffix(".png")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    layout = pages(names)
    page = PageFigure(*grid(max(len(members) for _, members in layout)))
    if len(layout) > 1 and out_path.suffix.lower() == ".pdf":
        from matplotlib.backends.backend_pdf import PdfPages

        with PdfPages(out_path) as pdf:
            for group, members in layout:
                page.draw(series, members, group)
                pdf.savefig(page.fig)
        return [out_path]
    paths = page_paths(out_path, [group for group, _ in layout])
    for (group, members), target in zip(layout, paths, strict=True):
        page.draw(series, members, group)
        page.fig.savefig(target, dpi=100)
    return paths


def select(series: Series, metrics: Sequence[str] | None, path: Any) -> list[str]:
    """The metric names to plot, checked against the file's."""
    if metrics is None:
        names = sorted(series)
    else:
        names = list(metrics)
        missing = [n for n in names if n not in series]
        if missing:
            raise ValueError(
                f"metrics {missing} are not in {os.fspath(path)!r}; it has: "
                f"{', '.join(sorted(series)) or 'none'}"
            )
    if not names:
        raise ValueError(f"{os.fspath(path)!r} holds no metrics to plot")
    return names


def split_names(text: str | None) -> list[str] | None:
    """``"a,b"`` as ["a", "b"]; None or "" as None (all metrics)."""
    if not text:
        return None
    return [name.strip() for name in text.split(",") if name.strip()]


def add_plot_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``RUN.jsonl --metrics a,b --out fig.png`` to a (sub)parser."""
    parser.add_argument("run", help="the JSONL metrics file (one object per step)")
    parser.add_argument(
        "--metrics", default=None, help="comma-separated metric names (default: all)"
    )
    parser.add_argument(
        "--out",
        default="",
        help=f"the image file (default: RUN with .png); more than {PAGE_SIZE} metrics go "
        "to one page per prefix group: one multi-page .pdf, or one file per page",
    )
    return parser


def run_plot(args: argparse.Namespace) -> int:
    """Plot from parsed arguments; returns the exit status (2, with a message, on error)."""
    try:
        written = plot_jsonl(args.run, split_names(args.metrics), args.out)
    except (OSError, ValueError, ImportError) as err:
        print(f"rlmetrics plot: error: {err}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(p) for p in _shorten(written)))
    return 0


def _shorten(paths: list[Path]) -> Iterator[str]:
    """The paths written, at most 4 named and the rest counted."""
    yield from (str(p) for p in paths[:4])
    if len(paths) > 4:
        yield f"... ({len(paths)} files)"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rlmetrics.plot RUN.jsonl [--metrics a,b] [--out fig.png]``."""
    parser = add_plot_arguments(
        argparse.ArgumentParser(prog="rlmetrics plot", description=__doc__.splitlines()[0])
    )
    return run_plot(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
