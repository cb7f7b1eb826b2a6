"""Print docs/scaling.md's tables: the model of ``scaling_model`` evaluated at R = 8, 64,
1024 ranks and N = 50, 500, 5,000 metrics.

    .venv/bin/python benchmarks/scaling_tables.py
"""

from __future__ import annotations

import scaling_model as model

RANKS = (8, 64, 1024)
METRICS = (50, 500, 5_000)
MICRO = 4  # values per metric per rank and step in a verl-style dict (micro-batches)
LIMIT = 200_000  # rlmetrics._engine.sync.GATHER_LIMIT, gathered floats
ELEMENTS = (10_000, 1_000_000)  # per rank and dist metric
BUCKETS = (2_000, 4_000)
# indicative constants for the time column (docs/scaling.md says where they come from)
ALPHA_US = {"gloo": 30.0, "nccl": 5.0}  # per sequential message round
BYTES_PER_US = {"gloo": 1_000.0, "nccl": 10_000.0}  # per rank link: 1 and 10 GB/s
FLOAT_US = 0.001  # host: one float added or maxed (numpy, memory bound)
PYTHON_US = 0.3  # host: one python float unpickled, appended and averaged
CALL_US = 20.0  # host: a collective call's own cost (dispatch, work object, wait)


def kib(n: float) -> str:
    """Bytes in KiB/MiB/GiB, 3 significant digits."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def contenders(ranks: int, n: int) -> dict[str, tuple[list[model.Collective], float]]:
    """Per contender: its collectives and its host work (µs, indicative)."""
    buf = model.buffers(model.mix(n))
    payload = model.pickle_bytes(n, MICRO)
    return {
        "gather": (model.rlmetrics_sync(buf, ranks, "gather"), ranks * buf.gather * FLOAT_US),
        "pair": (model.rlmetrics_sync(buf, ranks, "pair"), sum(buf.pair) * FLOAT_US),
        "verl": (model.verl_sync(payload), ranks * n * MICRO * PYTHON_US),
        "torchmetrics": (model.torchmetrics_sync(n), 2 * n * ranks * FLOAT_US),
    }


def received(collectives: list[model.Collective], ranks: int) -> int:
    """Payload bytes one rank receives (ring: what it sends; even split assumed)."""
    total = 0
    for c in collectives:
        if c.op == "all_gather":
            total += (ranks - 1) * c.size
        elif c.op == "all_reduce":
            total += 2 * (ranks - 1) * c.size // ranks
    return total


def time_ms(collectives: list[model.Collective], host_us: float, ranks: int, backend: str) -> str:
    """Indicative ms: rounds x alpha + received bytes / bandwidth + a fixed cost per
    collective call + host work."""
    t = model.totals(collectives, ranks, backend)
    us = t["rounds"] * ALPHA_US[backend] + received(collectives, ranks) / BYTES_PER_US[backend]
    us += t["collectives"] * CALL_US + host_us
    return f"{us / 1e3:,.2f}" if us < 1e4 else f"{us / 1e3:,.0f}"


NAMES = ("gather", "pair", "verl", "torchmetrics")


def rows_by_size() -> list[tuple[int, int, model.Buffers, dict]]:
    out = []
    for ranks in RANKS:
        for n in METRICS:
            out.append((ranks, n, model.buffers(model.mix(n)), contenders(ranks, n)))
    return out


def bytes_table() -> list[str]:
    rows = [
        "| R | N | G (floats per rank) | today's path | gather | pair | verl-style "
        "| torchmetrics |",
        "|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for ranks, n, buf, cs in rows_by_size():
        today = "gather" if ranks * buf.gather <= LIMIT else "pair"
        recv = " | ".join(kib(received(cs[k][0], ranks)) for k in NAMES)
        rows.append(f"| {ranks} | {n:,} | {buf.gather:,} | {today} | {recv} |")
    return rows


def rounds_table() -> list[str]:
    rows = [
        "| R | N | collectives: gather / pair / verl-style / torchmetrics "
        "| rounds, gloo | rounds, NCCL |",
        "|---:|---:|---|---|---|",
    ]
    for ranks, n, _, cs in rows_by_size():
        col = " / ".join(f"{len(cs[k][0]):,}" for k in NAMES)
        rounds = [
            " / ".join(f"{model.totals(cs[k][0], ranks, b)['rounds']:,}" for k in NAMES)
            for b in ("gloo", "nccl")
        ]
        rows.append(f"| {ranks} | {n:,} | {col} | {rounds[0]} | {rounds[1]} |")
    return rows


def host_table() -> list[str]:
    rows = [
        "| R | N | host: gather floats / pair floats / verl python floats | ms, gloo: "
        "gather / pair / verl-style / torchmetrics | ms, NCCL (same order) |",
        "|---:|---:|---|---|---|",
    ]
    for ranks, n, buf, cs in rows_by_size():
        host = f"{ranks * buf.gather:,} / {sum(buf.pair):,} / {ranks * n * MICRO:,}"
        ms = [" / ".join(time_ms(*cs[k], ranks, b) for k in NAMES) for b in ("gloo", "nccl")]
        rows.append(f"| {ranks} | {n:,} | {host} | {ms[0]} | {ms[1]} |")
    return rows


def quantile_table() -> list[str]:
    """Per quantile metric: dist (every element gathered) against a B-bucket sketch in
    the SUM buffer (pair path: two ring all_reduces, bytes independent of R)."""
    rows = [
        "| R | dist n=10^4 | dist n=10^6 | dist host memory n=10^6 | sketch B=2,000 "
        "(pair / gather) | sketch B=4,000 (pair / gather) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for ranks in RANKS:
        dist = [(ranks - 1) * model.FLOAT * model.dist_extra(n) for n in ELEMENTS]
        held = ranks * model.FLOAT * model.dist_extra(ELEMENTS[1])
        sketch = [
            f"{kib(2 * (ranks - 1) * model.FLOAT * b / ranks)} / "
            f"{kib((ranks - 1) * model.FLOAT * b)}"
            for b in BUCKETS
        ]
        rows.append(
            f"| {ranks} | {kib(dist[0])} | {kib(dist[1])} | {kib(held)} | "
            + " | ".join(sketch)
            + " |"
        )
    return rows


def crossover(ranks: int, backend: str) -> str:
    """The per-rank buffer size G (floats) below which the gather is faster than the
    pair, with the indicative constants (None: never / always)."""
    a, b = ALPHA_US[backend], BYTES_PER_US[backend]
    gather_rounds, pair_rounds = (
        ranks - 1,
        2 * model.Collective("all_reduce", 0).rounds(ranks, backend),
    )
    spare = (pair_rounds - gather_rounds) * a + CALL_US  # the gather's one call fewer
    if spare <= 0:
        return "never"
    per_float = (ranks - 1) * 8 / b + ranks * FLOAT_US - 4 * (ranks - 1) * 8 / (ranks * b)
    return "always" if per_float <= 0 else f"{spare / per_float:,.0f}"


def crossover_table() -> list[str]:
    rows = ["| R | gather faster below G = (gloo) | (NCCL, tree all_reduce) | today's limit |"]
    rows.append("|---:|---:|---:|---:|")
    for ranks in (2, 4, 8, 16, 64, 1024):
        rows.append(
            f"| {ranks} | {crossover(ranks, 'gloo')} | {crossover(ranks, 'nccl')} "
            f"| {LIMIT // ranks:,} |"
        )
    return rows


if __name__ == "__main__":
    tables = (bytes_table(), rounds_table(), host_table(), quantile_table(), crossover_table())
    for table in tables:
        print("\n".join(table), end="\n\n")
