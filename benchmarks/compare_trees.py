"""Run one benchmark against two revisions of the library, alternating, in one run.

    .venv/bin/python benchmarks/compare_trees.py --before REV [--after REV] --runs 5 \\
        -- log_bench.py --rounds 20

Each revision's ``src/`` and ``benchmarks/`` are exported (``git archive``) into a temp
folder; by default the working tree is the "after". The benchmark (each tree's own copy
of the script, so a script that reads internals runs against the internals it was
written for) runs ``--runs`` times per tree with ``--no-write``, the trees alternating
and the first tree swapped each run, so the machine's drift hits both alike. Every
markdown table the script prints is parsed; each numeric cell's median over the runs is
reported per tree, with the difference and the ratio. ``--write NAME`` puts the table in
``benchmarks/RESULTS.md`` between ``compare:NAME`` markers.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections import defaultdict
from io import BytesIO
from pathlib import Path

from results_md import load, machine, write_section

REPO = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
KEY_COLUMNS = {"ranks", "N", "world", "calls", "kind", "case", "input", "contender", "metric"}
"""Headers of the columns that, after the first, name a row rather than measure it."""

RUN_END = "\n<!-- end of run -->\n"  # between the runs of a --keep file
Cell = tuple[str, str, str]  # (the table's first header, row label, column header)


def export(rev: str, into: Path) -> Path:
    """``src/`` and ``benchmarks/`` of ``rev`` under ``into`` (``git archive``)."""
    tree = into / rev.replace("/", "_")
    tree.mkdir(parents=True)
    blob = subprocess.run(
        ["git", "archive", rev, "src", "benchmarks"], cwd=REPO, check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(blob)) as archive:
        archive.extractall(tree, filter="data")
    return tree


def tables(text: str) -> dict[Cell, float]:
    """Every numeric cell of every markdown table in ``text``: the first number of the
    cell (thousands separators allowed), keyed by (the table's first header, with its
    ordinal when an earlier table had the same header row, the row's label, the column's
    header). A row's label is its first cell and the cells after it
    under ``KEY_COLUMNS`` headers (``2 / 8`` for ranks 2, N 8). A table starts at a
    header row, the row right above a separator row (``|---|---:|``)."""
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        for line in text.splitlines()
    ]
    cells: dict[Cell, float] = {}
    header: list[str] | None = None
    seen: dict[tuple[str, ...], int] = {}  # tables with this header so far
    name = ""
    for i, row in enumerate(rows):
        if row is None:
            header = None
        elif _separator(row):
            continue
        elif i + 1 < len(rows) and rows[i + 1] is not None and _separator(rows[i + 1]):
            header = row
            seen[tuple(row)] = count = seen.get(tuple(row), 0) + 1
            name = row[0] if count == 1 else f"{row[0]} ({count})"
        elif header is not None:
            keys = 1
            while keys < len(header) and header[keys] in KEY_COLUMNS:
                keys += 1
            label = " / ".join(row[:keys])
            for column, cell in zip(header[keys:], row[keys:], strict=False):
                found = NUMBER.search(cell)
                if found:
                    cells[name, label, column] = float(found.group().replace(",", ""))
    return cells


def _separator(row: list[str] | None) -> bool:
    return row is not None and all(cell and set(cell) <= set("-: ") for cell in row)


def run_once(tree: Path, script: str, args: list[str], keep: Path | None) -> dict[Cell, float]:
    """One run of ``tree``'s own benchmark script, its library on the path (its output
    also appended to ``keep``/<tree>.txt)."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    done = subprocess.run(
        [sys.executable, str(tree / "benchmarks" / script), *args, "--no-write"],
        cwd=tree / "benchmarks",
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        sys.exit(f"{script} failed on {tree.name}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        with open(keep / f"{tree.name}.txt", "a") as out:
            out.write(done.stdout + RUN_END)
    return tables(done.stdout)


def compare(
    runs: dict[str, list[dict[Cell, float]]], before: str, after: str, only: list[str]
) -> list[str]:
    """The markdown table: per cell, the median per tree, after - before, after / before."""
    samples: dict[Cell, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for tree, results in runs.items():
        for result in results:
            for cell, value in result.items():
                samples[cell][tree].append(value)
    rows = [
        f"| table | row | column | {before} | {after} | after - before | after / before |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for (number, label, column), by_tree in sorted(samples.items(), key=lambda kv: kv[0]):
        if only and not any(word in column for word in only):
            continue
        if before not in by_tree or after not in by_tree:
            continue
        old, new = statistics.median(by_tree[before]), statistics.median(by_tree[after])
        ratio = f"{new / old:.3f}" if old else "-"
        rows.append(
            f"| {number} | {label} | {column} | {old:g} | {new:g} | {new - old:+.3g} | {ratio} |"
        )
    return rows


def run_trees(
    args: argparse.Namespace, after: str, script_args: list[str]
) -> dict[str, list[dict[Cell, float]]]:
    """Each tree's runs, alternating (the first tree swapped each run)."""
    with tempfile.TemporaryDirectory() as tmp:
        trees = {args.before: export(args.before, Path(tmp))}
        trees[after] = export(args.after, Path(tmp)) if args.after else REPO
        runs: dict[str, list[dict[Cell, float]]] = {name: [] for name in trees}
        for i in range(args.runs):
            order = list(trees) if i % 2 == 0 else list(reversed(trees))
            for name in order:
                runs[name].append(run_once(trees[name], args.script, script_args, args.keep))
                print(f"run {i + 1}/{args.runs}: {name} done", file=sys.stderr)
    return runs


def kept_runs(folder: Path, name: str) -> list[dict[Cell, float]]:
    """The runs a --keep folder holds for the tree ``name``."""
    file = REPO.name if name == "working tree" else name.replace("/", "_")
    text = (folder / f"{file}.txt").read_text()
    return [tables(run) for run in text.split(RUN_END) if run.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a git revision")
    parser.add_argument("--after", help="a git revision (default: the working tree)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--columns", nargs="*", default=[], help="keep columns naming these")
    parser.add_argument("--write", metavar="NAME", help="write the table into RESULTS.md")
    parser.add_argument("--keep", type=Path, help="a folder for each run's raw output")
    parser.add_argument(
        "--from-kept", type=Path, help="read the runs from a --keep folder instead of running"
    )
    parser.add_argument("script", help="the benchmark script, e.g. log_bench.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments (after --)")
    args = parser.parse_args(argv)
    script_args = [a for a in args.args if a != "--"]
    loads = [load()]
    after = args.after or "working tree"
    if args.from_kept:
        runs = {name: kept_runs(args.from_kept, name) for name in (args.before, after)}
    else:
        runs = run_trees(args, after, script_args)
    loads.append(load())
    rows = compare(runs, args.before, after, args.columns)
    print("\n".join(rows))
    if args.write:
        start, end = f"<!-- compare:{args.write}:start -->", f"<!-- compare:{args.write}:end -->"
        command = " ".join(["benchmarks/compare_trees.py", *(argv or sys.argv[1:])])
        text = "\n".join(
            [
                start,
                f"## compare:{args.write}: {args.script} before and after, alternating",
                "",
                f"Machine: {machine(f'{args.runs} runs per tree', (loads[0], loads[1]))}.",
                f"Command: `{command}`. Cells: each numeric cell's median over the runs.",
                "",
                *rows,
                end,
            ]
        )
        write_section(text, start, end)


if __name__ == "__main__":
    main()
