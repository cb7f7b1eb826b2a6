"""Tables of ``scaling_bench``: measured bytes and collectives next to the model's, time
medians and ratios, and a least-squares fit of the model's time terms."""

from __future__ import annotations

import datetime
import os
import platform
from dataclasses import dataclass, field

import numpy as np
import torch

import scaling_model as model
from rlmetrics._engine import sync as rd

from results_md import write_section

START, END = "<!-- scaling_bench:start -->", "<!-- scaling_bench:end -->"
CORES = os.cpu_count() or 1
LIMIT = rd.GATHER_LIMIT


@dataclass
class Record:
    """One (world, case, contender): medians over iterations and the model's counts."""

    world: int
    case: str
    name: str
    wall_us: float  # median over iterations of the slowest rank's wall time
    cpu_us: float  # median over iterations of the ranks' mean process CPU time
    written: list[tuple[int, int]]  # per rank: (min, max) bytes written over iterations
    modelled: list[int]  # per rank: the model's bytes written
    collectives: int
    issued_ok: bool  # every rank issued exactly the model's collectives
    features: dict[str, float] = field(default_factory=dict)

    @property
    def bytes_ok(self) -> bool:
        """Each rank wrote the same every iteration, and the group wrote what the model
        says. (Per rank, a ring all_reduce whose buffer does not split into 2R equal
        segments may send one segment's difference more or less than modelled.)"""
        steady = all(lo == hi for lo, hi in self.written)
        return steady and sum(lo for lo, _ in self.written) == sum(self.modelled)


def records(results: dict[int, list[tuple[str, list[dict]]]]) -> list[Record]:
    """Flatten the bench's per-rank results."""
    out = []
    for world, by_case in results.items():
        for case, every in by_case:
            for name in every[0]:
                out.append(record(world, case, name, [rank[name] for rank in every]))
    return out


def record(world: int, case: str, name: str, ranks: list[dict]) -> Record:
    samples = np.array([r["samples"] for r in ranks], dtype=np.float64)  # rank, iter, 3
    predicted = [model.Collective(op, size) for op, size in ranks[0]["predicted"]]
    t = model.totals(predicted, world)
    features = {k: t[k] for k in ("collectives", "messages", "rounds", "bytes")}
    features.update(ranks[0]["host"])
    return Record(
        world,
        case,
        name,
        float(np.median(samples[:, :, 0].max(axis=0))) / 1e3,
        float(np.median(samples[:, :, 1].mean(axis=0))) / 1e3,
        [(int(s[:, 2].min()), int(s[:, 2].max())) for s in samples],
        [model.gloo_written(predicted, world, rank) for rank in range(world)],
        len(predicted),
        all([tuple(x) for x in r["issued"]] == [tuple(x) for x in r["predicted"]] for r in ranks),
        features,
    )


def mismatches(recs: list[Record]) -> list[str]:
    """Per-rank detail of every record whose bytes or collectives differ from the model."""
    return [
        f"- {r.world} ranks, {r.case}, {r.name}: measured {r.written}, model {r.modelled}, "
        f"collectives as modelled: {r.issued_ok}"
        for r in recs
        if not (r.bytes_ok and r.issued_ok)
    ]


def bytes_line(recs: list[Record]) -> str:
    """How many (ranks, case, contender) cells wrote and issued exactly what the model
    says; the cells that did not are listed by ``mismatches``."""
    good = sum(r.bytes_ok and r.issued_ok for r in recs)
    return (
        f"Bytes and collectives against the model: {good} of {len(recs)} (ranks, case, "
        f"contender) cells equal" + ("." if good == len(recs) else "; these differ:")
    )


def time_table(recs: list[Record]) -> list[str]:
    """Per (ranks, case): medians of each contender, wall and CPU, the ratios to the
    gather, and where the switch belongs: the gathered floats R·G, the path
    ``GATHER_LIMIT`` takes and the one that measured faster in wall time."""
    cells: dict[tuple[int, str], dict[str, Record]] = {}
    for r in recs:
        cells.setdefault((r.world, r.case), {})[r.name] = r
    rows = [
        "| ranks | case | gather wall / CPU | pair wall / CPU | verl wall / CPU "
        "| torchmetrics wall / CPU | pair / gather (wall, CPU) | verl / gather (wall, CPU) "
        "| R·G floats | limit takes | faster (wall) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for (world, case), by_name in cells.items():
        g, p = by_name["gather"], by_name["pair"]
        found = [by_name.get(name) for name in ("gather", "pair", "verl", "torchmetrics")]
        times = ["-" if r is None else f"{r.wall_us:,.0f} / {r.cpu_us:,.0f}" for r in found]
        ratios = [
            "-" if r is None else f"{r.wall_us / g.wall_us:.2f}, {r.cpu_us / g.cpu_us:.2f}"
            for r in found[1:3]
        ]
        gathered = world * int(g.features["G"])
        switch = [
            f"{gathered:,}",
            "gather" if gathered <= LIMIT else "pair",
            "gather" if p.wall_us > g.wall_us else "pair",
        ]
        rows.append(f"| {world} | {case} | " + " | ".join(times + ratios + switch) + " |")
    return rows


def switch_line(recs: list[Record]) -> str:
    """Whether ``GATHER_LIMIT`` sends every (ranks, case) down the path that measured
    faster in wall time, and the cases where it does not."""
    by_cell: dict[tuple[int, str], dict[str, Record]] = {}
    for r in recs:
        by_cell.setdefault((r.world, r.case), {})[r.name] = r
    wrong = []
    for (world, case), by_name in sorted(by_cell.items(), key=lambda kv: kv[0][0]):
        g, p = by_name["gather"], by_name["pair"]
        size = int(g.features["G"])
        today = "gather" if world * size <= LIMIT else "pair"
        faster = "gather" if p.wall_us > g.wall_us else "pair"
        if today != faster:
            wrong.append(
                f"{world} ranks {case} (R·G {world * size:,}: {today}, pair / gather "
                f"{p.wall_us / g.wall_us:.2f})"
            )
    head = (
        f"`GATHER_LIMIT` ({LIMIT:,} gathered floats) takes the path that measured faster "
        f"in wall time in {len(by_cell) - len(wrong)} of {len(by_cell)} cases"
    )
    return head + (f"; not in: {', '.join(wrong)}." if wrong else ".")


TERMS = ("collectives", "messages", "bytes", "host_floats", "py_elements", "metrics")


def fit(recs: list[Record], target: str, latency: str) -> tuple[dict[str, float], np.ndarray]:
    """Least squares of ``target`` (wall_us or cpu_us) on a fixed cost per contender
    family and the model's terms (``latency``: messages or rounds), each sample weighted
    by 1/measured (relative error). Torchmetrics is left out (too few points)."""
    used = [r for r in recs if r.name != "torchmetrics"]
    terms = ("collectives", latency, *TERMS[2:])
    columns = [[float(r.name == "verl") for r in used], [float(r.name != "verl") for r in used]]
    columns += [[float(r.features.get(t, 0.0)) for r in used] for t in terms]
    a = np.array(columns).T
    y = np.array([getattr(r, target) for r in used])
    coef = nonnegative_lstsq(a / y[:, None], np.ones_like(y))
    names = ("fixed verl", "fixed rlmetrics", *terms)
    return dict(zip(names, coef.tolist(), strict=True)), (a @ coef) / y


def nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (terms fitted negative are dropped and
    the rest refitted: a cost is never a saving)."""
    keep = np.ones(a.shape[1], dtype=bool)
    coef = np.zeros(a.shape[1])
    while keep.any():
        coef[:] = 0.0
        coef[keep] = np.linalg.lstsq(a[:, keep], y, rcond=None)[0]
        if (coef >= 0).all():
            break
        keep &= coef > 0
    return coef


def fit_lines(recs: list[Record]) -> list[str]:
    out = []
    for target, latency, what in (
        ("cpu_us", "messages", "process CPU per rank"),
        ("wall_us", "rounds", "wall time (slowest rank)"),
    ):
        coef, ratio = fit(recs, target, latency)
        spread = np.abs(np.log(ratio))
        out.append(
            f"- {what}: "
            + ", ".join(f"{k} {v:.3g} µs" for k, v in coef.items())
            + f"; model / measured: median {np.median(ratio):.2f}, "
            f"{np.mean(spread < np.log(1.5)):.0%} of cells within 1.5x, "
            f"worst {np.exp(spread.max()):.2f}x."
        )
    return out


def machine(
    elapsed: float, worlds: list[int], loads: tuple[tuple[float, ...], tuple[float, ...]]
) -> str:
    start, end = (", ".join(f"{x:.1f}" for x in load) for load in loads)
    return (
        f"{CORES} CPUs (nproc), {platform.processor() or platform.machine()}, Python "
        f"{platform.python_version()}, torch {torch.__version__}, gloo on 127.0.0.1, "
        f"OMP_NUM_THREADS=1, load average (1, 5, 15 min) {start} before, {end} after, "
        f"{datetime.date.today().isoformat()}. Settings: `--worlds "
        f"{' '.join(map(str, worlds))}`, {elapsed:.0f} s"
    )


def section(results: dict, elapsed: float, loads: tuple) -> str:
    recs = records(results)
    return "\n".join(
        [
            START,
            "## scaling_bench: the scaling model against gloo ranks "
            "(`benchmarks/scaling_bench.py`, the model in `docs/scaling.md`)",
            "",
            "Bytes each rank writes to its sockets in one sync (`wchar` of /proc/self/io) "
            "and the collectives it issues, against the model's counts, and the sync's "
            "time for rlmetrics' gather, its all_reduce pair, verl-style and torchmetrics.",
            "",
            f"Machine: {machine(elapsed, list(results), loads)}.",
            "",
            bytes_line(recs),
            *mismatches(recs),
            "",
            "Medians in µs; wall: the slowest rank's per iteration, CPU: the ranks' mean "
            f"process CPU time (above {CORES} ranks the ranks share the cores: compare "
            "ratios); and where the switch belongs:",
            "",
            *time_table(recs),
            "",
            switch_line(recs),
            "",
            "Model fit (least squares, relative): time = fixed cost + latency term + "
            "per byte + per host float reduced + per python element unpickled + per metric.",
            "",
            *fit_lines(recs),
            END,
        ]
    )


def write(text: str) -> None:
    write_section(text, START, END)
