"""Benchmark one RL step's metrics on one process: every log call, then the step's end.

Run from the repository root (about a minute on 2 cores):

    .venv/bin/python benchmarks/step_bench.py

Options: ``--steps 40`` (timed steps per contender, after ``--warmup 3``),
``--floats 400``, ``--scalars 50`` and ``--tensors 50`` (metrics per kind of input),
``--micro 4`` (micro-batches: log calls per metric and step), ``--elements 1000``
(per tensor call), ``--no-write`` (print only). By default the table is written into
``benchmarks/RESULTS.md`` between the ``step_bench`` markers.

A step is the metric traffic of a PPO/GRPO update on one rank: each micro-batch logs
``floats`` python floats (mean, sum, max, min and last metrics in turn), ``scalars``
0-d float32 tensors (as a loss is) and ``tensors`` float32 tensors of ``elements``
tokens with a bool mask (entropies, ratios, clip flags), and the step ends with the
values of every metric. Contenders, each used as its users use it:

* rlmetrics: the log calls, then ``compute(sync=False)`` (host path for CPU data);
* rlmetrics tensor path: the same with ``Tracker.reduce_host_data_with_numpy = False`` and
  ``copy_cpu_tensors = False`` (the path a CUDA tensor takes, recorded by reference; on
  a GPU its torch ops would run asynchronously);
* torchmetrics: one ``MeanMetric`` (or ``SumMetric``, ``MaxMetric``, ``MinMetric``) per
  metric, ``update`` per call, ``compute`` and ``reset`` of each at the end (the last
  value kept in a dict, as torchmetrics has no such metric);
* verl-style: each call reduced to a python float at once (the masked mean of a tensor,
  then ``.item()``), appended to a dict of lists, and ``np.mean`` (or sum, max, min,
  last) per key at the end.

Samples are thread-time per step (the whole step: log calls and end), contenders
interleaved step by step so that drift hits all alike; the table gives medians and
each contender's ratio to rlmetrics. It measures one process's host cost; the sync
between ranks is ``sync_bench``'s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from rlmetrics import Tracker

from results_md import load, machine, write_section

START, END = "<!-- step_bench:start -->", "<!-- step_bench:end -->"
CONTENDERS = ("rlmetrics", "rlmetrics tensor path", "torchmetrics", "verl-style")
KINDS = ("mean", "sum", "max", "min", "last")
Step = Callable[[], dict[str, float]]


def inputs(args: argparse.Namespace) -> list[list[tuple[str, str, object, object]]]:
    """Per micro-batch, the step's log calls: (name, kind, value, mask or None)."""
    gen = torch.Generator().manual_seed(0)
    batches = []
    for micro in range(args.micro):
        calls: list[tuple[str, str, object, object]] = []
        for i in range(args.floats):
            calls.append((f"float/{i}", KINDS[i % len(KINDS)], 0.5 + micro + i * 1e-3, None))
        for i in range(args.scalars):
            calls.append((f"loss/{i}", "mean", torch.rand((), generator=gen), None))
        for i in range(args.tensors):
            values = torch.randn(args.elements, generator=gen)
            mask = torch.rand(args.elements, generator=gen) > 0.3
            calls.append((f"token/{i}", "mean", values, mask))
        batches.append(calls)
    return batches


def rlmetrics_step(batches: list, reduce_host_data_with_numpy: bool) -> Step:
    tracker = Tracker()
    tracker.reduce_host_data_with_numpy = tracker.copy_cpu_tensors = reduce_host_data_with_numpy
    methods = {kind: getattr(tracker, kind) for kind in KINDS}

    def step() -> dict[str, float]:
        for calls in batches:
            for name, kind, value, mask in calls:
                methods[kind](name, value, weight=mask)
        return tracker.compute(sync=False)

    return step


def torchmetrics_step(batches: list) -> Step:
    from torchmetrics import MaxMetric, MeanMetric, MinMetric, SumMetric

    made = {"mean": MeanMetric, "sum": SumMetric, "max": MaxMetric, "min": MinMetric}
    metrics = {name: made[kind]() for name, kind, _, _ in batches[0] if kind in made}
    last: dict[str, float] = {}

    def step() -> dict[str, float]:
        for calls in batches:
            for name, kind, value, mask in calls:
                if kind == "last":
                    last[name] = float(value)
                elif mask is None:
                    metrics[name].update(value)
                else:
                    metrics[name].update(value, weight=mask)
        out = {name: float(metric.compute()) for name, metric in metrics.items()}
        for metric in metrics.values():
            metric.reset()
        return {**out, **last}

    return step


def verl_step(batches: list) -> Step:
    reduce = {"mean": np.mean, "sum": np.sum, "max": np.max, "min": np.min, "last": lambda x: x[-1]}
    kinds = {name: kind for name, kind, _, _ in batches[0]}

    def step() -> dict[str, float]:
        store: dict[str, list[float]] = {}
        for calls in batches:
            for name, _, value, mask in calls:
                if mask is not None:
                    value = ((value * mask).sum() / mask.sum()).item()
                elif isinstance(value, torch.Tensor):
                    value = value.item()
                store.setdefault(name, []).append(value)
        return {name: float(reduce[kinds[name]](values)) for name, values in store.items()}

    return step


def run(args: argparse.Namespace) -> dict[str, list[float]]:
    """Per contender, thread-time µs of each timed step, contenders interleaved."""
    batches = inputs(args)
    steps = {
        "rlmetrics": rlmetrics_step(batches, True),
        "rlmetrics tensor path": rlmetrics_step(batches, False),
        "torchmetrics": torchmetrics_step(batches),
        "verl-style": verl_step(batches),
    }
    check_agree({name: step() for name, step in steps.items()})
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for index in range(args.warmup + args.steps):
        for name, step in steps.items():
            start = time.thread_time_ns()
            step()
            if index >= args.warmup:
                samples[name].append((time.thread_time_ns() - start) / 1000)
    return samples


def check_agree(results: dict[str, dict[str, float]]) -> None:
    """Every contender reports the same metrics as torchmetrics, to float32 rounding
    (the contenders measure the same work), except verl-style's token metrics: a mean
    of micro-batch means, which is not the token mean (the drift rlmetrics removes)."""
    reference = results["torchmetrics"]
    for name, values in results.items():
        if values.keys() != reference.keys():
            raise AssertionError(f"{name} reports other metrics than torchmetrics")
        for key, value in values.items():
            if name == "verl-style" and key.startswith("token/"):
                continue
            if not np.isclose(value, reference[key], rtol=1e-4, atol=1e-6):
                raise AssertionError(f"{name}: {key} = {value}, torchmetrics {reference[key]}")


def markdown(samples: dict[str, list[float]], args: argparse.Namespace) -> list[str]:
    """The table: median and p90 ms per step, and each contender's ratio to rlmetrics."""
    base = statistics.median(samples["rlmetrics"])
    rows = ["| contender | ms per step, median | p90 | / rlmetrics |", "|---|---:|---:|---:|"]
    for name in CONTENDERS:
        xs = sorted(samples[name])
        p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
        med = statistics.median(xs)
        rows.append(f"| {name} | {med / 1000:.2f} | {p90 / 1000:.2f} | {med / base:.2f}x |")
    verl, tm = (statistics.median(samples[c]) / base for c in ("verl-style", "torchmetrics"))
    rows += [
        "",
        f"rlmetrics / verl-style: {1 / verl:.2f}x (verl-style reduces each call at once: "
        f"a device sync per call on a GPU); torchmetrics / rlmetrics: {tm:.1f}x.",
    ]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--floats", type=int, default=400)
    parser.add_argument("--scalars", type=int, default=50)
    parser.add_argument("--tensors", type=int, default=50)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--elements", type=int, default=1000)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    import torchmetrics

    torch.set_num_threads(1)
    before = load()
    samples = run(args)
    loads = (before, load())
    rows = markdown(samples, args)
    detail = f"torchmetrics {torchmetrics.__version__}, torch threads 1"
    calls = args.micro * (args.floats + args.scalars + args.tensors)
    text = "\n".join(
        [
            START,
            "## step_bench: one RL step's metrics on one process (`benchmarks/step_bench.py`)",
            "",
            f"One rank's step of metrics: {args.micro} micro-batches x ({args.floats} "
            f"python floats of mean, sum, max, min and last metrics, {args.scalars} 0-d "
            f"float32 tensors, {args.tensors} float32 tensors of {args.elements} elements "
            f"with a bool mask) = {calls:,} log calls, then the step's values; thread time.",
            "",
            f"Machine: {machine(detail, loads)}. Settings: `--steps {args.steps} --warmup "
            f"{args.warmup}`.",
            "",
            *rows,
            END,
        ]
    )
    print(text)
    if not args.no_write:
        write_section(text, START, END)


if __name__ == "__main__":
    main()
