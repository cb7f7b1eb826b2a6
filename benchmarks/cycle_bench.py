"""Benchmark a tracker that logs a few disjoint sets of metrics in turn, over gloo:
collectives and wall time per step, rlmetrics against the protocol before recent
layouts were reused, verl-style and torchmetrics, in one run.

Run from the repository root (about a minute on 2 idle cores; more under load):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cycle_bench.py

Options: ``--cycles 1 2 3 4 9`` (sets in turn; 1 is the steady state), ``--metrics 16``
(per set), ``--rounds 10``, ``--world 2``, ``--no-write`` (print only). By default the
section between the ``cycle_bench`` markers of ``benchmarks/RESULTS.md`` is replaced.

A trainer that logs rollout metrics one step and update metrics the next, or a
``Window``'s phases, comes back every k steps to a set of names its ranks agreed on.
For each cycle length k the ranks take k warm-up steps (each set's first, which agrees
its schema), then ``--rounds`` rounds of k steps. Each step every contender logs that
step's set (``--metrics`` metrics of mixed kinds, 4 micro-batches of python floats)
untimed; then, in an order drawn each step (the same on every rank, so that no
contender always follows another), all ranks pass a barrier and time one contender's
sync, counting the collectives it issues (every ``torch.distributed`` all_gather,
all_reduce, broadcast, all_gather_into_tensor, as ``all_gather_object`` issues them
too). A sample is the slowest rank's time.

* rlmetrics: one ``Tracker`` over a process group of its own, ``compute()``;
* before: another ``Tracker`` over another group whose layouts are chosen as the sync
  chose them before recent layouts were reused (the group's newest layout when it holds
  the step's names, else an agreement): the same code otherwise, so the difference
  between the two rows is the protocol;
* verl-style: ``all_gather_object`` of a ``dict[str, list[float]]``, a mean per key;
* torchmetrics: a ``MetricCollection`` of ``MeanMetric``s per set, ``compute()`` (reset
  untimed).

The first measured step's mean-kind values are compared across the contenders, and
rlmetrics' whole result against before's (the same bits).
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import gc
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from rlmetrics import Tracker
from rlmetrics._engine import sync as rd
from rlmetrics._engine.layout import BufferLayout
from rlmetrics._engine.record import MetricRecords
from spawn_ranks import serve_rank, spawn_ranks

from results_md import load, machine, write_section
from sync_contenders import KINDS, MICRO_BATCHES, Values

START, END = "<!-- cycle_bench:start -->", "<!-- cycle_bench:end -->"
CONTENDERS = ("rlmetrics", "before", "verl-style", "torchmetrics")
COUNTED = ("all_gather", "all_reduce", "broadcast", "all_gather_into_tensor")


class NewestOnly(rd.GroupLayouts):
    """A group's layouts as the sync used them before recent layouts were reused: a
    step packs the newest layout when it holds the step's names, else the ranks agree."""

    def newest_fitting(
        self, metric_records: Mapping[str, MetricRecords], known: Any = None, *_: Any
    ) -> BufferLayout | None:
        newest = self.layouts[:1]
        return next((lay for lay in newest if lay is known or lay.fits(metric_records)), None)


class Contender:
    """One way to sync a step of one of the sets: ``prepare`` (untimed), ``run`` (timed)."""

    def prepare(self, names: list[str], values: Values) -> None:
        raise NotImplementedError

    def run(self) -> Any:
        raise NotImplementedError

    def finish(self) -> None:
        """Untimed clean-up after ``run``."""


class RlMetrics(Contender):
    """One tracker over ``group``, whatever set a step logs."""

    def __init__(self, group: Any) -> None:
        self.tracker, self.group = Tracker(), group

    def prepare(self, names: list[str], values: Values) -> None:
        methods = [getattr(self.tracker, KINDS[i % len(KINDS)]) for i in range(len(names))]
        for mb in range(MICRO_BATCHES):
            for log, name, vals in zip(methods, names, values, strict=True):
                log(name, vals[mb])

    def run(self) -> dict[str, float]:
        return self.tracker.compute(group=self.group)


class VerlStyle(Contender):
    """A dict of lists per step, ``all_gather_object``, a mean per key."""

    def __init__(self) -> None:
        self.metrics: dict[str, list[float]] = {}

    def prepare(self, names: list[str], values: Values) -> None:
        self.metrics = {name: list(vals) for name, vals in zip(names, values, strict=True)}

    def run(self) -> dict[str, float]:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.metrics)
        return {k: float(np.mean([v for d in gathered for v in d[k]])) for k in gathered[0]}


class TorchMetrics(Contender):
    """A ``MetricCollection`` of ``MeanMetric``s per set, made at the set's first step."""

    def __init__(self) -> None:
        self.collections: dict[tuple[str, ...], Any] = {}
        self.current: Any = None

    def prepare(self, names: list[str], values: Values) -> None:
        from torchmetrics import MeanMetric, MetricCollection

        key = tuple(names)
        if key not in self.collections:
            self.collections[key] = MetricCollection(
                {name: MeanMetric() for name in names}, compute_groups=False
            )
        self.current = self.collections[key]
        for mb in range(MICRO_BATCHES):
            for name, vals in zip(names, values, strict=True):
                self.current[name].update(vals[mb])

    def run(self) -> dict[str, Any]:
        return self.current.compute()

    def finish(self) -> None:
        self.current.reset()


def count_collectives() -> dict[str, int]:
    """Count this rank's collectives from now on, through either namespace."""
    counts = {"n": 0}
    for name in COUNTED:
        original = getattr(c10d, name)

        def wrapped(*args: Any, _original: Callable[..., Any] = original, **kw: Any) -> Any:
            counts["n"] += 1
            return _original(*args, **kw)

        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)
    return counts


def set_names(index: int, size: int) -> list[str]:
    return [f"set{index}/m{i:02d}" for i in range(size)]


def step_values(seed: int, rank: int, step: int, size: int) -> Values:
    """This rank's values of one step's set; ``last`` metrics agree across ranks."""
    values = np.random.default_rng((seed, rank, step)).normal(1.0, 0.5, (size, MICRO_BATCHES))
    shared = np.random.default_rng((seed, step)).normal(1.0, 0.5, (size, MICRO_BATCHES))
    is_last = np.arange(size) % len(KINDS) == KINDS.index("last")
    return np.where(is_last[:, None], shared, values).tolist()


def check_agree(outs: dict[str, Any], names: list[str]) -> None:
    """rlmetrics equals before; the mean-kind metrics agree across every contender."""
    assert outs["rlmetrics"] == outs["before"], "rlmetrics and before disagree"
    for i, name in enumerate(names):
        if KINDS[i % len(KINDS)] == "mean":
            ref = outs["verl-style"][name]
            assert math.isclose(outs["rlmetrics"][name], ref, rel_tol=1e-12), name
            assert math.isclose(float(outs["torchmetrics"][name]), ref, rel_tol=1e-5), name


def bench_cycle(rank: int, sets: int, args: argparse.Namespace) -> dict[str, list[int]]:
    """Per contender, this rank's (wall ns, collectives) per measured step."""
    groups = dist.new_group(list(range(args.world))), dist.new_group(list(range(args.world)))
    rd._GROUP_LAYOUTS[groups[1]] = NewestOnly()  # before: its layouts chosen the old way
    contenders: dict[str, Contender] = {
        "rlmetrics": RlMetrics(groups[0]),
        "before": RlMetrics(groups[1]),
        "verl-style": VerlStyle(),
        "torchmetrics": TorchMetrics(),
    }
    counts = count_collectives()
    out: dict[str, list[int]] = {f"{k}{c}": [] for c in CONTENDERS for k in ("", "n:")}
    order = list(contenders)
    for step in range(sets * (args.rounds + 1)):
        names = set_names(step % sets, args.metrics)
        values = step_values(args.seed, rank, step, args.metrics)
        outs = {}
        for name in np.random.default_rng((args.seed, step)).permutation(order).tolist():
            c = contenders[name]
            c.prepare(names, values)
            dist.barrier()
            gc.disable()
            before, start = counts["n"], time.perf_counter_ns()
            outs[name] = c.run()
            elapsed, issued = time.perf_counter_ns() - start, counts["n"] - before
            gc.enable()
            c.finish()
            if step >= sets:
                out[name].append(elapsed)
                out[f"n:{name}"].append(issued)
        if step == sets:  # the first measured step's results, compared
            check_agree(outs, names)
    return out


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    """One rank: every cycle length in turn; rank 0 sends the per-step max over ranks."""
    torch.set_num_threads(1)

    def every_cycle() -> dict[int, dict[str, list[int]]]:
        results = {}
        for sets in args.cycles:
            mine = bench_cycle(rank, sets, args)
            every: list[Any] = [None] * world
            dist.all_gather_object(every, mine)
            results[sets] = {k: np.max([r[k] for r in every], axis=0).tolist() for k in mine}
        return results

    serve_rank(rank, world, port, queue, every_cycle)


def table(results: dict[int, dict[str, list[int]]]) -> list[str]:
    """Markdown rows: per cycle length and contender, collectives and time per step."""
    rows = [
        "| sets in turn | contender | collectives per step | µs per step, median | p90 | "
        "/ rlmetrics |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for sets, times in results.items():
        rl = float(np.median(times["rlmetrics"])) / 1e3
        for name in CONTENDERS:
            us = np.array(times[name], dtype=np.float64) / 1e3
            issued = np.array(times[f"n:{name}"])
            per_step = f"{issued.mean():.2f}"
            if issued.min() != issued.max():
                per_step += f" ({issued.min()} to {issued.max()})"
            median = float(np.median(us))
            rows.append(
                f"| {sets} | {name} | {per_step} | {median:,.0f} | "
                f"{np.percentile(us, 90):,.0f} | {median / rl:.2f}x |"
            )
    return rows


def section(
    results: dict[int, dict[str, list[int]]],
    args: argparse.Namespace,
    loads: tuple[str, str],
    seconds: float,
) -> str:
    """The whole marked section of RESULTS.md."""
    import torchmetrics

    detail = (
        f"torchmetrics {torchmetrics.__version__}, {args.world} gloo ranks on 127.0.0.1, "
        "OMP_NUM_THREADS=1"
    )
    settings = (
        f"`--cycles {' '.join(map(str, args.cycles))} --metrics {args.metrics} "
        f"--rounds {args.rounds} --world {args.world}`, {seconds:.0f} s"
    )
    return "\n".join(
        [
            START,
            "## cycle_bench: disjoint sets of metrics logged in turn (`benchmarks/cycle_bench.py`)",
            "",
            f"Each step logs one of k disjoint sets of {args.metrics} scalar metrics "
            "(mean, sum, max, min, last; 4 micro-batches of python floats), the sets in "
            "turn, and syncs it; measured after each set's first step. before: the same "
            "tracker code with each step's layout chosen as before recent layouts were "
            "reused (the newest only, else an agreement). A sample is the slowest rank's "
            "time; the contenders run in a random order drawn each step, each after a barrier.",
            "",
            f"Machine: {machine(detail, loads)}. Settings: {settings}.",
            "",
            *table(results),
            END,
        ]
    )


def main(argv: list[str] | None = None) -> None:
    """Run every cycle length, print the table, write RESULTS.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, nargs="+", default=[1, 2, 3, 4, rd.RECENT + 1])
    parser.add_argument("--metrics", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    start, before = time.perf_counter(), load()
    results = spawn_ranks(worker, args.world, (args,), args.timeout)
    loads = (before, load())
    seconds = time.perf_counter() - start
    print("\n".join(table(results)))
    print(f"load average {loads[0]} before, {loads[1]} after; total {seconds:.0f} s")
    if not args.no_write:
        write_section(section(results, args, loads, seconds), START, END)


if __name__ == "__main__":
    main()
