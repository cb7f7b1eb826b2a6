"""Plot a JSONL metrics file: one subplot per metric against step (matplotlib, Agg).

From the command line: ``rlmetrics plot RUN.jsonl --metrics a,b --out fig.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def read_jsonl(path: str | os.PathLike) -> dict[str, tuple[list[int], list[float]]]:
    """Each metric's (steps, values) from a JSONL metrics file; null reads as NaN.

    Lines that do not parse (a torn last line) are skipped.
    """
    series: dict[str, tuple[list[int], list[float]]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
                step = int(row["step"])
            except (ValueError, KeyError, TypeError):
                continue
            for name, value in row.items():
                if name == "step" or isinstance(value, bool | str | dict | list):
                    continue
                steps, values = series.setdefault(name, ([], []))
                steps.append(step)
                values.append(math.nan if value is None else float(value))
    return series


def plot_jsonl(
    path: str | os.PathLike, metrics: Sequence[str] | None = None, out: str | os.PathLike = ""
) -> Path:
    """Save a figure with one subplot per metric (all metrics when None) to ``out``.

    Args:
        path: the JSONL file (``{"step": n, "<name>": value, ...}`` per line).
        metrics: the names to plot, in order; None plots every metric, sorted.
        out: the image file (its suffix picks the format); "" means ``path`` with .png.

    Returns:
        The path written.

    Raises:
        ValueError: a requested metric is not in the file, or the file has none.
        ImportError: matplotlib is missing (``pip install 'rlmetrics[plot]'``).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            f"plotting needs matplotlib ({err}); install it with: pip install 'rlmetrics[plot]'"
        ) from err
    series = read_jsonl(path)
    names = select(series, metrics, path)
    out_path = Path(out) if out else Path(path).with_suffix(".png")
    fig = Figure(figsize=(8, 2.2 * len(names) + 0.6), layout="constrained")
    axes = fig.subplots(len(names), 1, sharex=True, squeeze=False)[:, 0]
    for ax, name in zip(axes, names, strict=True):
        steps, values = series[name]
        ax.plot(steps, values, marker="." if len(steps) < 50 else None, linewidth=1.2)
        ax.set_title(name, fontsize=10, loc="left")
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    return out_path


def select(series: dict[str, Any], metrics: Sequence[str] | None, path: Any) -> list[str]:
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
    parser.add_argument("--out", default="", help="the image file (default: RUN with .png)")
    return parser


def run_plot(args: argparse.Namespace) -> int:
    """Plot from parsed arguments; returns the exit status (2, with a message, on error)."""
    try:
        out = plot_jsonl(args.run, split_names(args.metrics), args.out)
    except (OSError, ValueError) as err:
        print(f"rlmetrics plot: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rlmetrics.plot RUN.jsonl [--metrics a,b] [--out fig.png]``."""
    parser = add_plot_arguments(
        argparse.ArgumentParser(prog="rlmetrics plot", description=__doc__.splitlines()[0])
    )
    return run_plot(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
