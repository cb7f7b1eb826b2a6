"""Benchmark one step's metric sync over gloo: rlmetrics vs its floor and four other ways.

Run from the repository root (about 10 minutes on 2 idle cores; more under load):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sync_bench.py

Options: ``--worlds 2 4``, ``--sizes 8 64 512``, ``--iters 200``, ``--warmup 8``,
``--no-write`` (print only). By default the section between the ``sync_bench`` markers
of ``benchmarks/RESULTS.md`` is replaced; the rest of that file is kept as it is.

For each world size the script spawns that many processes on 127.0.0.1 (gloo, one
thread each). Every iteration each rank logs the same fresh values (python floats from
a few micro-batches) into every contender, untimed; then, contender by contender in an
order that rotates each iteration, all ranks pass a barrier and time the sync alone:

* rlmetrics: ``Tracker.compute()`` of N scalar metrics of mixed kinds;
* bare: the collective a steady-state ``compute()`` issues (recorded from one call),
  with float64 CPU tensors of the sizes rlmetrics packs: one all_gather of the SUM and
  MAX parts, rows added in rank order and maxed on the host (groups up to
  ``rlmetrics._engine.sync.GATHER_LIMIT`` gathered floats, so every size here), plus the
  host read;
* local: a second tracker logged the same values, ``compute(sync=False)``: the local
  work of a ``compute()`` without its collective;
* local then bare: a third tracker's ``compute(sync=False)`` and then the bare
  collective, in one timed run: the floor of a sync that does its local work and then
  its collective, as ``compute()`` must (the collective carries what the fold made);
* bare pair: one all_reduce(SUM) and one all_reduce(MAX) of the buffers rlmetrics packs
  for them (recorded too; the SUM part carries NaN counts), what rlmetrics issues above
  the limit, plus the host read;
* verl-style: ``all_gather_object`` of a ``dict[str, list[float]]``, then a mean per key;
* torchmetrics: ``MetricCollection`` of N ``MeanMetric``s, ``compute()`` (reset untimed),
  run on every k-th iteration only when N is large;
* torcheval: a dict of N ``Mean``s, ``toolkit.sync_and_compute_collection`` (reset
  untimed), every k-th iteration only when N is large.

The contenders live in ``sync_contenders.py``.

A sample is the max over ranks of that iteration's time (the step waits for the
slowest rank). Warm-up iterations are discarded; medians and p90 are reported.

The sync target (issue 34): with 2 ranks, which share this machine's two cores so that
a rank's local work cannot hide behind the other's, ``compute()`` at most 1.10x the
bare collective plus the local ``compute(sync=False)`` (their medians summed); with 4
ranks, at most 1.25x the bare collective.

Then each rank counts the torch ops one ``compute()`` dispatches after 100 and after
10,000 log calls (``sync_ops.py``), and the load average before and after is reported.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import gc
import math
import time
import traceback
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from spawn_ranks import spawn_ranks

import sync_ops
from results_md import load, machine, write_section
from sync_contenders import (
    KINDS,
    MICRO_BATCHES,
    Contender,
    Local,
    LocalThenBare,
    RlMetrics,
    TorchEval,
    TorchMetrics,
    Values,
    VerlStyle,
    bare_contenders,
)

START, END = "<!-- sync_bench:start -->", "<!-- sync_bench:end -->"
CONTENDERS = (
    "rlmetrics",
    "bare",
    "local",
    "local then bare",
    "bare pair",
    "verl",
    "torchmetrics",
    "torcheval",
)
# the sync target per world size: (the ratio's denominator, its largest value)
SYNC_TARGET = {2: (("bare", "local"), 1.10), 4: (("bare",), 1.25)}
CPU = "cpu:"  # key prefix of process-CPU times
# samples wanted from the slow contenders at N <= 8, N <= 64, larger N (2 ranks, more)
SLOW_SAMPLES = {"torchmetrics": (60, 15, (4, 3)), "torcheval": (60, 20, (6, 5))}


def every_kth(name: str, world: int, n: int, iters: int) -> int:
    """The slow contenders run on every k-th measured iteration only, at larger N
    (torchmetrics: ~4 collectives per metric; torcheval: one per state of each metric)."""
    if name not in SLOW_SAMPLES:
        return 1
    small, medium, (large_2, large_more) = SLOW_SAMPLES[name]
    samples = small if n <= 8 else medium if n <= 64 else large_2 if world <= 2 else large_more
    return max(1, math.ceil(iters / samples))


def step_values(seed: int, rank: int, it: int, n: int) -> Values:
    """This rank's values for one iteration: N metrics x MICRO_BATCHES python floats.

    ``last`` metrics (replicated values such as the learning rate) agree across ranks.
    """
    values = np.random.default_rng((seed, rank, it + 1, n)).normal(1.0, 0.5, (n, MICRO_BATCHES))
    shared = np.random.default_rng((seed, it + 1, n)).normal(1.0, 0.5, (n, MICRO_BATCHES))
    is_last = np.arange(n) % len(KINDS) == KINDS.index("last")
    return np.where(is_last[:, None], shared, values).tolist()


def skip(it: int, warmup: int, every: int) -> bool:
    """Whether a slow contender sits out iteration ``it`` (when it runs on every k-th
    iteration only, its only warm-up is the untimed check round)."""
    if every == 1:
        return False
    return it < warmup or (it - warmup) % every != 0


def timed(contender: Contender) -> tuple[int, int]:
    """Barrier, then this rank's wall and process-CPU nanoseconds for ``contender.run()``
    (gc paused). CPU time counts every thread of the rank (gloo's too), not the waits."""
    dist.barrier()
    gc.disable()
    start, cpu = time.perf_counter_ns(), time.process_time_ns()
    contender.run()
    elapsed, cpu = time.perf_counter_ns() - start, time.process_time_ns() - cpu
    gc.enable()
    return elapsed, cpu


def check_agree(outs: dict[str, Any], names: list[str]) -> None:
    """The mean-kind metrics agree across rlmetrics, verl-style, torchmetrics and
    torcheval."""
    for i, name in enumerate(names):
        if KINDS[i % len(KINDS)] != "mean":
            continue
        ref = outs["verl"][name]
        assert math.isclose(outs["rlmetrics"][name], ref, rel_tol=1e-12), name
        if "torchmetrics" in outs:  # float32 states
            assert math.isclose(float(outs["torchmetrics"][name]), ref, rel_tol=1e-5), name
        if "torcheval" in outs:  # float64 states, summed in another order
            assert math.isclose(float(outs["torcheval"][name]), ref, rel_tol=1e-12), name


def bench_size(rank: int, world: int, n: int, args: argparse.Namespace) -> dict[str, list[int]]:
    """Per-contender, per-iteration times (ns) of this rank; -1 where not run."""
    names = [f"m{i:03d}" for i in range(n)]
    rl = RlMetrics(names)
    rl.prepare(step_values(args.seed, rank, -1, n))
    rl.run()  # agree the schema once, as a training run's first step does
    bare, pair = bare_contenders(rl, step_values(args.seed, rank, -1, n))  # steady state
    local, serial_local = Local(names), Local(names)
    for _ in range(3):  # as many steps as rl has taken (its first and two recorded)
        for tracker in (local, serial_local):
            tracker.prepare(step_values(args.seed, rank, -1, n))
            tracker.run()
    serial = LocalThenBare(serial_local, bare)
    contenders: list[Contender] = [rl, bare, local, serial, pair, VerlStyle(names)]
    contenders.append(TorchMetrics(names))
    contenders.append(TorchEval(names))
    every = {c.name: every_kth(c.name, world, n, args.iters) for c in contenders}
    times: dict[str, list[int]] = {k + c.name: [] for c in contenders for k in ("", CPU)}
    for it in range(args.warmup + args.iters):
        values = step_values(args.seed, rank, it, n)
        if it == 0:
            check_outputs(contenders, names, values)
        shift = it % len(contenders)
        for c in contenders[shift:] + contenders[:shift]:
            if skip(it, args.warmup, every[c.name]):
                times[c.name].append(-1)
                times[CPU + c.name].append(-1)
                continue
            c.prepare(values)
            wall, cpu = timed(c)
            times[c.name].append(wall)
            times[CPU + c.name].append(cpu)
            c.finish()
    out = {k: v[args.warmup :] for k, v in times.items()}
    out["floats"] = [bare.sums.numel(), bare.maxes.numel()]
    out["bare gathers"] = [int(bare.gather)]
    return out


def check_outputs(contenders: list[Contender], names: list[str], values: Values) -> None:
    """One untimed round whose outputs are compared (sanity, not part of the timing)."""
    outs: dict[str, Any] = {}
    for c in contenders:
        c.prepare(values)
        outs[c.name] = c.run()
        c.finish()
    check_agree(outs, names)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    """One rank: every N in turn, then the op counts; rank 0 sends the per-iteration max
    over ranks (``times``) and its op counts (``ops``)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        out: dict[int, dict[str, list[int]]] = {}
        start = time.perf_counter()
        for n in args.sizes:
            mine = bench_size(rank, world, n, args)
            every: list[Any] = [None] * world
            dist.all_gather_object(every, mine)
            out[n] = {k: np.max([r[k] for r in every], axis=0).tolist() for k in mine}
            if rank == 0:
                print(f"{world} ranks, N={n}: done at {time.perf_counter() - start:.0f} s")
        ops = sync_ops.measure()
        if rank == 0:
            queue.put({"times": out, "ops": ops})
    except BaseException as error:
        queue.put(f"rank {rank}: {type(error).__name__}: {error}\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def run_world(world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Spawn ``world`` gloo ranks and return rank 0's merged timings and op counts."""
    return spawn_ranks(worker, world, (args,), args.timeout)


def stats(samples: list[int]) -> tuple[float, float, int]:
    """(median, p90) in microseconds and the sample count, ignoring skipped (-1) ones."""
    us = np.array([s for s in samples if s >= 0], dtype=np.float64) / 1e3
    return float(np.median(us)), float(np.percentile(us, 90)), len(us)


def medians(
    results: dict[int, dict[int, dict[str, list[int]]]], prefix: str = ""
) -> dict[tuple[int, int], dict]:
    """{(ranks, N): {contender: (median, p90, samples)}}; ``prefix=CPU`` for CPU times."""
    return {
        (world, n): {c: stats(times[prefix + c]) for c in CONTENDERS}
        for world, by_n in results.items()
        for n, times in by_n.items()
    }


def table(results: dict[int, dict[int, dict[str, list[int]]]], prefix: str = "") -> list[str]:
    """Markdown rows: medians / p90 per contender and the ratios to rlmetrics."""
    rows = [
        "| ranks | N | SUM+MAX floats | rlmetrics | bare | local | local then bare | bare pair "
        "| verl-style "
        "| torchmetrics | torcheval | rl / bare | tm / rl | te / rl | verl / rl |",
        "|---:|---:|---:" + "|---:" * (len(CONTENDERS) + 4) + "|",
    ]
    for (world, n), s in medians(results, prefix).items():
        floats = "+".join(map(str, results[world][n]["floats"]))
        if not results[world][n]["bare gathers"][0]:
            floats += " (pair)"  # above rd.GATHER_LIMIT: bare is the pair too
        cells = [f"{s[c][0]:,.0f} / {s[c][1]:,.0f} ({s[c][2]})" for c in CONTENDERS]
        rl = s["rlmetrics"][0]
        ratios = [rl / s["bare"][0]] + [s[c][0] / rl for c in ("torchmetrics", "torcheval", "verl")]
        rows.append(
            f"| {world} | {n} | {floats} | "
            + " | ".join(cells)
            + " | "
            + " | ".join(f"{r:.2f}x" for r in ratios)
            + " |"
        )
    return rows


def sync_ratios(
    results: dict[int, dict[int, dict[str, list[int]]]], prefix: str = ""
) -> dict[tuple[int, int], tuple[float, float]]:
    """{(ranks, N): (rlmetrics / its floor, the target)} for the world sizes the sync
    target covers: the floor is the median bare collective, plus the median local
    ``compute(sync=False)`` with 2 ranks."""
    out = {}
    for (world, n), s in medians(results, prefix).items():
        if world in SYNC_TARGET:
            floor, limit = SYNC_TARGET[world]
            out[world, n] = (s["rlmetrics"][0] / sum(s[c][0] for c in floor), limit)
    return out


def sync_target_table(results: dict[int, dict[int, dict[str, list[int]]]]) -> list[str]:
    """The sync target's rows: medians (wall) of rlmetrics, bare and local, the ratio
    against the floor the world size is judged by, in wall and CPU time, and rlmetrics
    against local then bare (the serial floor)."""
    wall, cpu = medians(results), sync_ratios(results, CPU)
    rows = [
        "| ranks | N | rlmetrics µs | bare µs | local µs | ratio | target | met (wall) | "
        "ratio, CPU time | local then bare µs | rl / (local then bare) |",
        "|---:|---:|---:|---:|---:|---|---:|---|---:|---:|---:|",
    ]
    for (world, n), (ratio, limit) in sync_ratios(results).items():
        s = wall[world, n]
        parts = SYNC_TARGET[world][0]
        floor = parts[0] if len(parts) == 1 else f"({' + '.join(parts)})"
        rows.append(
            f"| {world} | {n} | {s['rlmetrics'][0]:,.0f} | {s['bare'][0]:,.0f} | "
            f"{s['local'][0]:,.0f} | rl / {floor} = {ratio:.2f}x | ≤ {limit:.2f}x | "
            f"{'met' if ratio <= limit else 'missed'} | {cpu[world, n][0]:.2f}x | "
            f"{s['local then bare'][0]:,.0f} | "
            f"{s['rlmetrics'][0] / s['local then bare'][0]:.2f}x |"
        )
    return rows


def verdict(results: dict[int, dict[int, dict[str, list[int]]]], prefix: str = "") -> list[str]:
    """One line per target, each with the measured ratios and met / missed."""
    m = medians(results, prefix)
    ratio = {k: (v["rlmetrics"][0], v["verl"][0], v["torchmetrics"][0]) for k, v in m.items()}
    sync = sync_ratios(results, prefix)
    tm = {k: t / rl for k, (rl, _, t) in ratio.items() if k[1] == 64}
    verl = {k: v / rl for k, (rl, v, _) in ratio.items() if k[1] == 512}
    saved = {k: (v - rl) / 1000 for k, (rl, v, _) in ratio.items() if k[1] == 512}

    def fmt(values: dict[tuple[int, int], float]) -> str:
        return ", ".join(f"{w} ranks N={n}: {r:.2f}x" for (w, n), r in values.items()) or "-"

    def met(ok: bool, values: dict) -> str:
        return "not measured" if not values else "met" if ok else "missed"

    def grows(values: dict) -> bool:
        return len(values) < 2 or list(values.values()) == sorted(values.values())

    faster = all(r > 1 for r in verl.values())
    margins = ", ".join(f"{w} ranks: {ms:.1f} ms" for (w, _), ms in saved.items()) or "-"
    missed = [f"{w} ranks N={n}" for (w, n), (r, limit) in sync.items() if r > limit]
    return [
        f"- sync target (2 ranks ≤ 1.10x bare + local, 4 ranks ≤ 1.25x bare): "
        f"{met(not missed, sync)}" + (f" (missed at {', '.join(missed)})" if missed else "") + ".",
        f"- torchmetrics / rlmetrics ≥ 100x at N=64: {fmt(tm)}; "
        f"{met(all(r >= 100 for r in tm.values()), tm)}.",
        f"- verl-style slower at N=512, by more at more ranks: time saved per step "
        f"(verl-style - rlmetrics) {margins}; {met(faster and grows(saved), saved)}; "
        f"as a ratio {fmt(verl)}; {met(faster and grows(verl), verl)}.",
    ]


def machine_line(loads: tuple[str, str]) -> str:
    """Where the numbers come from (``results_md.machine``)."""
    import torcheval
    import torchmetrics

    detail = (
        f"torchmetrics {torchmetrics.__version__}, torcheval {torcheval.__version__}, "
        "gloo on 127.0.0.1, OMP_NUM_THREADS=1"
    )
    return machine(detail, loads)


def section(
    results: dict,
    ops: dict[int, sync_ops.Counts],
    args: argparse.Namespace,
    loads: tuple[str, str],
    seconds: float,
) -> str:
    """The whole marked section of RESULTS.md."""
    settings = (
        f"`--worlds {' '.join(map(str, args.worlds))} --sizes {' '.join(map(str, args.sizes))} "
        f"--iters {args.iters} --warmup {args.warmup}`, {seconds:.0f} s"
    )
    return "\n".join(
        [
            START,
            "## sync_bench: one step's metric sync (`benchmarks/sync_bench.py`)",
            "",
            "`Tracker.compute()` of N scalar metrics (mean, sum, max, min, last; 4 "
            "micro-batches of python floats) on gloo ranks, against the bare collective of "
            "the same bytes, the same tracker state's `compute(sync=False)` (local), "
            "verl-style, torchmetrics and torcheval; each iteration the contenders run in "
            "a rotating order, each after a barrier; a sample is the slowest rank's time.",
            "",
            f"Machine: {machine_line(loads)}. Settings: {settings}.",
            "",
            "Sync target (issue 34): 2 ranks ≤ 1.10x (bare + local), 4 ranks ≤ 1.25x bare; "
            "medians, wall time:",
            "",
            *sync_target_table(results),
            "",
            "Wall time, median / p90 µs (samples):",
            "",
            *table(results),
            "",
            *verdict(results),
            "",
            "Process CPU time (all threads of a rank, gloo's included; waits excluded), "
            "median / p90 µs (samples):",
            "",
            *table(results, CPU),
            "",
            f"Torch ops dispatched by one `compute()` after {sync_ops.CALLS[0]:,} and "
            f"{sync_ops.CALLS[-1]:,} log calls of {sync_ops.NUM_METRICS} metrics of 0-d CPU "
            "tensors (rank 0, the collective included; the tensor path is the one a CUDA "
            "tensor takes):",
            "",
            *sync_ops.markdown(ops),
            "",
            sync_ops.verdict(ops),
            END,
        ]
    )


def main(argv: list[str] | None = None) -> None:
    """Run every world size, print the table, write RESULTS.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="s per world")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    start, before = time.perf_counter(), load()
    runs = {world: run_world(world, args) for world in args.worlds}
    loads = (before, load())
    results = {world: run["times"] for world, run in runs.items()}
    ops = {world: run["ops"] for world, run in runs.items()}
    for prefix, what in (("", "wall"), (CPU, "process CPU")):
        print(f"{what} time, median / p90 us (samples):")
        print("\n".join(table(results, prefix)))
        print("\n".join(verdict(results, prefix)))
    print("\n".join(sync_target_table(results)))
    print("\n".join(sync_ops.markdown(ops)))
    print(sync_ops.verdict(ops))
    print(f"load average {loads[0]} before, {loads[1]} after")
    seconds = time.perf_counter() - start
    print(f"total {seconds:.0f} s")
    if not args.no_write:
        write_section(section(results, ops, args, loads, seconds), START, END)


if __name__ == "__main__":
    main()
