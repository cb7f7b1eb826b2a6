"""The quantile sketch against numpy: observed error per data set, and state size vs dist.

Run from the repository root (about a minute on 2 cores):

    PYTHONPATH=src .venv/bin/python benchmarks/sketch_bench.py

Options: ``--sizes 1000 10000 100000 1000000``, ``--alpha 0.01``, ``--seed 0``,
``--no-write`` (print only). By default the tables are written into
``benchmarks/RESULTS.md`` between the ``sketch_bench`` markers.

For each skewed data set and size n, one tracker logs the data (in 4 chunks, as CPU
tensors) into a ``QuantileSketch`` and into ``dist``. The observed error of each
reported quantile is measured against numpy on the whole batch: against
``np.quantile(method="lower")``, the rank the sketch reports (its guarantee: relative
error <= alpha), and against dist's value (numpy's default linear interpolation), the
difference a user switching from dist would see. State size: the sketch's packed slots
(8 bytes each, whatever n); dist's kept elements (8 bytes each) and the vector it
gathers at sync (values and keep flags, 16 bytes per element).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from rlmetrics import Tracker, register_kind
from rlmetrics.kinds.dist import Dist, as_array, quantile_suffix
from rlmetrics.kinds.quantile import QuantileSketch

from results_md import load, machine, write_section

START, END = "<!-- sketch_bench:start -->", "<!-- sketch_bench:end -->"
QUANTILES = (0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 0.999)
DATASETS: dict[str, Callable[[np.random.Generator, int], np.ndarray]] = {
    "lognormal(0, 2.5)": lambda r, n: r.lognormal(0.0, 2.5, n),
    "pareto(1.1)": lambda r, n: r.pareto(1.1, n) + 1.0,
    "cauchy": lambda r, n: r.standard_cauchy(n),
    "70% zeros + exponential": lambda r, n: np.where(r.random(n) < 0.7, 0.0, r.exponential(2, n)),
    "-lognormal(1, 1.5)": lambda r, n: -r.lognormal(1.0, 1.5, n),
    "mixed signs": lambda r, n: r.normal(0.5, 3.0, n) * r.lognormal(0.0, 1.0, n),
    "tiny (1e-7 lognormal)": lambda r, n: r.lognormal(0.0, 1.0, n) * 1e-7,
    "huge (1e7 lognormal)": lambda r, n: r.lognormal(0.0, 1.0, n) * 1e7,
    "lengths (geometric)": lambda r, n: r.geometric(0.002, n).astype(np.float64),
}


def relative_errors(got: np.ndarray, true: np.ndarray) -> np.ndarray:
    """|got - true| / |true|, 0 where both are 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(got == true, 0.0, np.abs(got - true) / np.abs(true))


def log_all(tracker: Tracker, x: np.ndarray, kind: str) -> None:
    """``x`` in 4 chunks (CPU tensors) into metric "m" of ``kind``."""
    for chunk in np.array_split(x, 4):
        tracker.log("m", torch.from_numpy(chunk), kind=kind)


def timed(x: np.ndarray, kind: str) -> tuple[dict[str, float], float]:
    """One step's results and its log + compute seconds."""
    tracker = Tracker(quantiles=QUANTILES)
    start = time.perf_counter()
    log_all(tracker, x, kind)
    out = tracker.compute()
    return out, time.perf_counter() - start


def measure(kind: QuantileSketch, x: np.ndarray) -> dict[str, float]:
    """Log ``x`` into the sketch and into dist; errors, sizes and seconds."""
    sketch_out, sketch_s = timed(x, kind.name)
    dist_out, dist_s = timed(x, "dist")
    tracker = Tracker(quantiles=QUANTILES)
    log_all(tracker, x, kind.name)
    state = tracker.state().metrics["m"]
    tracker = Tracker(quantiles=QUANTILES)
    log_all(tracker, x, "dist")
    dist_state = tracker.state().metrics["m"]
    suffixes = [quantile_suffix(q) for q in QUANTILES]
    got = np.array([sketch_out[f"m/{s}"] for s in suffixes])
    lower = np.quantile(x, QUANTILES, method="lower")
    linear = np.array([dist_out[f"m/{s}"] for s in suffixes])
    in_range = (np.abs(lower) >= kind.min_positive) & (np.abs(lower) <= kind.max_value)
    return {
        "err_lower": float(relative_errors(got, lower)[in_range].max(initial=0.0)),
        "err_dist": float(relative_errors(got, linear).max()),
        "sketch_bytes": 8 * (len(state.sums) + len(state.maxes)),
        "dist_bytes": 8 * len(dist_state.sums) + as_array(dist_state.extra).nbytes,
        "dist_gather_bytes": 8 * Dist().vector_length(x.size),
        "sketch_s": sketch_s,
        "dist_s": dist_s,
    }


def run(sizes: list[int], alpha: float, seed: int) -> dict[tuple[str, int], dict[str, float]]:
    """Every (data set, n) measurement."""
    kind = QuantileSketch(name="bench_sketch", alpha=alpha, quantiles=QUANTILES)
    register_kind(kind, exist_ok=True)
    measure(kind, np.arange(1.0, 100.0))  # warm-up: first calls pay one-off costs
    rows = {}
    for name, make in DATASETS.items():
        for n in sizes:
            rows[name, n] = measure(kind, make(np.random.default_rng(seed), n))
            print(name, n, rows[name, n], flush=True)
    return rows


def first_set() -> str:
    """The data set the size table reports."""
    return next(iter(DATASETS))


def tables(
    rows: dict[tuple[str, int], dict[str, float]],
    sizes: list[int],
    alpha: float,
    loads: tuple[str, str],
) -> str:
    """The markdown section."""
    kind = QuantileSketch(name="bench_sketch", alpha=alpha)
    worst = max(r["err_lower"] for r in rows.values())
    bound = kind.relative_error
    ratio = [
        rows[first_set(), n]["dist_gather_bytes"] / rows[first_set(), n]["sketch_bytes"]
        for n in sizes
    ]
    head = " | ".join(f"n={n:,}" for n in sizes)
    rule = "|---|" + "---:|" * len(sizes)
    lines = [
        START,
        "## sketch_bench: quantile sketch error and size (`benchmarks/sketch_bench.py`)",
        "",
        "The quantile sketch's observed error against numpy on the whole batch, per "
        "skewed data set and size, and its state against dist's (one process, CPU).",
        "",
        f"Machine: {machine(f'numpy {np.__version__}, torch threads 1', loads)}.",
        "",
        f"Sketch: alpha = {alpha}, range [{kind.min_positive:g}, {kind.max_value:g}], "
        f"{kind.num_sums} SUM + {kind.num_maxes} MAX slots; stated relative error "
        f"{kind.relative_error:.6g}. Quantiles {', '.join(f'{q:g}' for q in QUANTILES)}.",
        "",
        "Largest observed relative error of the sketch's quantiles against numpy's "
        '`method="lower"` (the rank it reports; quantiles whose value lies in the range):',
        "",
        f"| data set | {head} |",
        rule,
    ]
    for name in DATASETS:
        lines.append(
            f"| {name} | " + " | ".join(f"{rows[name, n]['err_lower']:.2e}" for n in sizes) + " |"
        )
    lines += [
        "",
        "Largest relative difference from dist's values (numpy's default linear "
        "interpolation between two ranks), what switching from dist changes:",
        "",
        f"| data set | {head} |",
        rule,
    ]
    for name in DATASETS:
        lines.append(
            f"| {name} | " + " | ".join(f"{rows[name, n]['err_dist']:.2e}" for n in sizes) + " |"
        )
    first = first_set()
    lines += [
        "",
        f"State per metric (bytes) and one-process log + compute time ({first}):",
        "",
        f"| | {head} |",
        rule,
        "| sketch state (packed slots) | "
        + " | ".join(f"{rows[first, n]['sketch_bytes']:,}" for n in sizes)
        + " |",
        "| dist state (kept elements) | "
        + " | ".join(f"{rows[first, n]['dist_bytes']:,}" for n in sizes)
        + " |",
        "| dist sync vector (values + flags) | "
        + " | ".join(f"{rows[first, n]['dist_gather_bytes']:,}" for n in sizes)
        + " |",
        "| sketch log + compute, s | "
        + " | ".join(f"{rows[first, n]['sketch_s']:.3f}" for n in sizes)
        + " |",
        "| dist log + compute, s | "
        + " | ".join(f"{rows[first, n]['dist_s']:.3f}" for n in sizes)
        + " |",
        "",
        f"Target: observed error ≤ the stated {bound:.6g} in every cell: largest "
        f"{worst:.2e}, {'met' if worst <= bound else 'missed'}. dist's sync vector / the "
        "sketch's state: "
        + ", ".join(
            f"{r:.2f}x at n={n:,}" if r < 10 else f"{r:,.0f}x at n={n:,}"
            for r, n in zip(ratio, sizes, strict=True)
        )
        + ".",
        END,
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10**3, 10**4, 10**5, 10**6])
    parser.add_argument("--alpha", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    before = load()
    rows = run(args.sizes, args.alpha, args.seed)
    text = tables(rows, args.sizes, args.alpha, (before, load()))
    print(text)
    if not args.no_write:
        write_section(text, START, END)


if __name__ == "__main__":
    main()
