"""Benchmark ``rlmetrics plot`` without ``--metrics``: seconds and peak memory per metric count.

Run from the repository root (a minute or two on 2 cores):

    .venv/bin/python benchmarks/plot_bench.py

Options: ``--counts 30,100,300``, ``--steps 150`` (lines per file), ``--no-write``
(print only). By default the table is written into ``benchmarks/RESULTS.md`` between
the ``plot_bench`` markers; the rest of that file is kept as it is.

Each count gets a JSONL file like a training run's: ``--steps`` lines, the metrics
spread over 6 prefix groups (``actor/``, ``critic/``, ...), every value a float. Each
plot runs in a fresh ``python -m rlmetrics.plot`` process (the command a user types),
timed from start to exit with matplotlib's import included; peak memory is the child's
maximum resident set size (``getrusage``). Everything is written to a temp folder.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_md import write_section

START, END = "<!-- plot_bench:start -->", "<!-- plot_bench:end -->"
GROUPS = ("actor", "critic", "perf", "timing_s", "response_length", "eval")
TARGET_S = 30.0  # the bound for 300 metrics


def write_run(path: Path, num_metrics: int, steps: int) -> None:
    """A JSONL file of ``steps`` lines with ``num_metrics`` metrics in 6 groups."""
    rng = random.Random(num_metrics)
    names = [f"{GROUPS[i % len(GROUPS)]}/m{i:03d}" for i in range(num_metrics)]
    with open(path, "w", encoding="utf-8") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps({"step": step, **{n: rng.random() for n in names}}) + "\n")


def plot_once(run: Path, out: Path, env: dict[str, str]) -> tuple[float, float, float, int]:
    """Wall seconds, CPU seconds, peak RSS in MiB and files written by one
    ``python -m rlmetrics.plot``."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        child = subprocess.Popen(
            [sys.executable, "-m", "rlmetrics.plot", str(run), "--out", str(out)],
            env=env, stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
        _, status, usage = os.wait4(child.pid, 0)  # this child's own peak memory
        seconds = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode:
            err.seek(0)
            raise RuntimeError(f"rlmetrics plot failed: {err.read().decode()}")
    files = len(list(out.parent.glob(out.stem + "*" + out.suffix)))
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, files


def run(counts: list[int], steps: int) -> list[dict]:
    """One row per metric count."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="plot-bench-") as tmp:
        env = {**os.environ, "MPLCONFIGDIR": str(Path(tmp) / "mpl"), "TMPDIR": tmp}
        src = Path(__file__).resolve().parents[1] / "src"
        env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
        for n in counts:
            run_file = Path(tmp) / f"run{n}.jsonl"
            write_run(run_file, n, steps)
            out = Path(tmp) / f"out{n}" / "fig.png"
            out.parent.mkdir()
            seconds, cpu, peak_mib, files = plot_once(run_file, out, env)
            rows.append({"metrics": n, "seconds": seconds, "cpu": cpu, "peak_mib": peak_mib,
                         "files": files})  # fmt: skip
            print(f"{n} metrics: {seconds:.1f} s wall, {cpu:.1f} s CPU, {peak_mib:.0f} MiB, "
                  f"{files} files", flush=True)  # fmt: skip
    return rows


def load_average() -> str:
    try:
        return ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def machine(load_before: str, load_after: str) -> str:
    """Where the numbers come from (no torch: plotting does not need it)."""
    return (
        f"{os.cpu_count()} CPUs (nproc), {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}, load average (1, 5, 15 min) {load_before} "
        f"before, {load_after} after, {datetime.date.today().isoformat()}"
    )


def render(rows: list[dict], steps: int, load_before: str, load_after: str) -> str:
    """The RESULTS.md section."""
    biggest = max(rows, key=lambda r: r["metrics"])
    ok = {clock: "met" if biggest[clock] < TARGET_S else "NOT met" for clock in ("seconds", "cpu")}
    lines = [
        START,
        "## plot_bench: `rlmetrics plot` of every metric (`benchmarks/plot_bench.py`)",
        "",
        f"One fresh `python -m rlmetrics.plot RUN --out fig.png` per metric count (imports "
        f"included, no `--metrics`) on a JSONL file of {steps} steps, the metrics in 6 "
        "prefix groups.",
        "",
        f"Machine: {machine(load_before, load_after)}.",
        "",
        "| metrics | wall s | CPU s | peak RSS MiB | files (pages) |",
        "|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['metrics']} | {r['seconds']:.1f} | {r['cpu']:.1f} | {r['peak_mib']:.0f} | "
        f"{r['files']} |"
        for r in rows
    ]
    lines += [
        "",
        f"Target: {biggest['metrics']} metrics under {TARGET_S:.0f} s: wall {ok['seconds']}, "
        f"CPU {ok['cpu']}.",
        END,
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="30,100,300")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    counts = [int(x) for x in args.counts.split(",")]
    before = load_average()
    rows = run(counts, args.steps)
    text = render(rows, args.steps, before, load_average())
    print(text)
    if not args.no_write:
        write_section(text, START, END)


if __name__ == "__main__":
    main()
