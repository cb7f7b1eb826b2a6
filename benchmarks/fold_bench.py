"""Benchmark the host fold: a step's log calls and ``compute()`` against the eager way.

Run from the repository root (about a minute on 2 cores):

    .venv/bin/python benchmarks/fold_bench.py

Options: ``--rounds 21`` (timed rounds, after one warm-up), ``--calls 200 3000`` (log
calls per step), ``--elements 1000`` (per call), ``--metrics 8`` (the names the calls
go to, in turn), ``--big 4000000`` (elements of the one call of the per-element rows),
``--evict 64`` (MB of the pass that evicts the caches), ``--no-write`` (print only).
By default the table is written into ``benchmarks/RESULTS.md`` between the
``fold_bench`` markers.

Rows (issue 30, item 1), each on CPU float32 tensors with a bool mask, host path
(``Tracker`` defaults), torch on one thread, thread time:

* a step of ``calls`` calls of ``elements`` elements: ``t.mean(name, x, weight=mask)``
  per call then ``compute(sync=False)``, against the eager verl-style step (per call
  ``metrics[name].append(((x * mask).sum() / mask.sum()).item())``, then ``np.mean``
  per name), in µs per call; target: at most the eager cost (stretch: half of it).
  Three cases: fresh tensors each call over ``metrics`` names; and issue 44's
  measurement, fresh tensors or one reused tensor and mask (a loss term logged each
  micro-batch from a reused buffer) logged every call to one name, against its eager
  way (per call ``(x * mask).sum().item()`` and ``mask.sum().item()`` added up). Each
  in two conditions, since a step's cost here is mostly memory traffic: caches in use
  (each contender's step timed right after an untimed one of its own, the best case)
  and caches evicted (a pass over ``--evict`` MB of other memory first, as a training
  step's forward and backward passes leave the caches before its metrics are read);
* one call of ``big`` elements of a mean, sum, max and min metric then
  ``compute(sync=False)``, in ns per element; target: at most 4 ns;
* ``compute(sync=False)`` alone of 8 mean metrics with one python float each (the
  fixed cost of a step's end), in µs; target: at most 150 µs.

A second table counts the torch ops one ``compute()`` dispatches (``op_count``) after
100 and 4,000 log calls of issue 44's mixed step: 4 metrics in turn (a 1k float32
tensor with a bool mask, a 0-d tensor, a python float, a 1k tensor to a max), host
path, CPU tensors copied (the default) or recorded by reference; target: the same
count whatever the calls.

Every round runs each row's contenders once each, back to back in a random order, the
rows in a new shuffled order, so the machine's drift hits them alike. The table gives
each contender's median over the rounds, and the median of the rounds' ratios: each a
ratio of two runs made together. The
rlmetrics results are checked against numpy over the whole batch before timing.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from rlmetrics import Tracker

from op_count import count_ops
from results_md import load, machine, write_section

START, END = "<!-- fold_bench:start -->", "<!-- fold_bench:end -->"
KINDS = ("mean", "sum", "max", "min")
NS_PER_ELEMENT = 4.0
COMPUTE_US = 150.0
Call = tuple[str, torch.Tensor, torch.Tensor]


def masked_calls(calls: int, elements: int, metrics: int, seed: int) -> list[Call]:
    """``calls`` (name, float32 values, bool mask) log calls over ``metrics`` names."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            f"token/{i % metrics}",
            torch.randn(elements, generator=gen),
            torch.rand(elements, generator=gen) > 0.3,
        )
        for i in range(calls)
    ]


def rlmetrics_step(calls: list[Call]) -> Callable[[], dict[str, float]]:
    tracker = Tracker()
    mean = tracker.mean

    def step() -> dict[str, float]:
        for name, x, mask in calls:
            mean(name, x, weight=mask)
        return tracker.compute(sync=False)

    return step


def eager_step(calls: list[Call]) -> Callable[[], dict[str, float]]:
    def step() -> dict[str, float]:
        metrics: dict[str, list[float]] = {}
        for name, x, mask in calls:
            metrics.setdefault(name, []).append(((x * mask).sum() / mask.sum()).item())
        return {name: float(np.mean(values)) for name, values in metrics.items()}

    return step


def eager_sums_step(calls: list[Call]) -> Callable[[], dict[str, float]]:
    """Issue 44's eager way: per call the masked sum and the mask's count read at once,
    added up; their quotient at the end (one name)."""

    def step() -> dict[str, float]:
        total = count = 0.0
        for _, x, mask in calls:
            total += (x * mask).sum().item()
            count += mask.sum().item()
        return {calls[0][0]: total / count}

    return step


def big_step(kind: str, x: torch.Tensor, mask: torch.Tensor) -> Callable[[], dict[str, float]]:
    tracker = Tracker()
    log = getattr(tracker, kind)

    def step() -> dict[str, float]:
        log("big", x, weight=mask)
        return tracker.compute(sync=False)

    return step


def compute_only(metrics: int) -> Callable[[], float]:
    """Thread-time ns of a ``compute(sync=False)`` of ``metrics`` mean metrics with one
    python float each (the log calls untimed)."""
    tracker = Tracker()
    names = [f"loss/{i}" for i in range(metrics)]

    def step() -> float:
        for i, name in enumerate(names):
            tracker.mean(name, 0.5 + i)
        start = time.thread_time_ns()
        tracker.compute(sync=False)
        return float(time.thread_time_ns() - start)

    return step


def reference(calls: list[Call]) -> dict[str, float]:
    """numpy's masked mean per name over the whole step's elements."""
    by_name: dict[str, list[Call]] = {}
    for call in calls:
        by_name.setdefault(call[0], []).append(call)
    out = {}
    for name, mine in by_name.items():
        x = np.concatenate([c[1].numpy().astype(np.float64) for c in mine])
        mask = np.concatenate([c[2].numpy() for c in mine])
        out[name] = float(x[mask].sum() / mask.sum())
    return out


def check(got: dict[str, float], want: dict[str, float], what: str) -> None:
    """rlmetrics agrees with numpy over the whole batch (to float64 rounding)."""
    if got.keys() != want.keys() or not all(
        np.isclose(got[k], want[k], rtol=1e-12, atol=0) for k in want
    ):
        raise AssertionError(f"{what}: rlmetrics {got} != numpy {want}")


def timed(
    step: Callable[[], object], before: Callable[[], object] | None = None
) -> Callable[[], float]:
    """``step`` timed: thread-time ns of a call, after ``before`` (untimed)."""

    def run() -> float:
        if before is not None:
            before()
        start = time.thread_time_ns()
        step()
        return float(time.thread_time_ns() - start)

    return run


def evictor(megabytes: int) -> Callable[[], object]:
    """A pass that reads and writes ``megabytes`` of memory no contender uses, which
    leaves the caches holding none of theirs."""
    other = torch.zeros(megabytes << 18)  # float32: 4 bytes each
    return lambda: other.add_(1.0)


CONDITIONS = ("caches in use", "caches evicted")
CASES = ("fresh", "fresh, one mean", "reused, one mean")
CASE_NAMES = {
    "fresh": "fresh tensors",
    "fresh, one mean": "fresh tensors, one mean",
    "reused, one mean": "one reused tensor, one mean",
}


def run(args: argparse.Namespace) -> dict[str, list[float]]:
    """Per (row, contender), its samples: µs per call, ns per element or µs."""
    steps: dict[str, tuple[Callable[[], float], float]] = {}  # name -> (timed step, divisor)
    evict = evictor(args.evict)
    for calls in args.calls:
        for case in CASES:
            if case == "fresh":
                data = masked_calls(calls, args.elements, args.metrics, seed=calls)
            elif case == "fresh, one mean":
                data = masked_calls(calls, args.elements, 1, seed=calls)
            else:  # one tensor and mask, logged every call to one name
                data = masked_calls(1, args.elements, 1, seed=calls) * calls
            mine = rlmetrics_step(data)
            eager = eager_step(data) if case == "fresh" else eager_sums_step(data)
            check(mine(), reference(data), f"{calls} calls, {case}")
            for condition in CONDITIONS:
                for name, step in (("rlmetrics", mine), ("eager", eager)):
                    before = step if condition == "caches in use" else evict
                    key = f"{calls} calls {case} {condition} {name}"
                    steps[key] = (timed(step, before), 1000.0 * calls)
    gen = torch.Generator().manual_seed(1)
    x, mask = torch.randn(args.big, generator=gen), torch.rand(args.big, generator=gen) > 0.3
    selected = x.numpy()[mask.numpy()].astype(np.float64)
    expected = {"mean": selected.mean(), "sum": selected.sum(), "max": selected.max()}
    expected["min"] = selected.min()
    for kind in KINDS:
        step = big_step(kind, x, mask)
        check(step(), {"big": float(expected[kind])}, f"{kind} of {args.big}")
        steps[f"{kind} rlmetrics"] = (timed(step), float(args.big))
    steps["compute rlmetrics"] = (compute_only(8), 1000.0)
    samples: dict[str, list[float]] = {name: [] for name in steps}
    units: dict[str, list[str]] = {}  # a row's contenders run back to back
    for name in steps:
        units.setdefault(name.rsplit(" ", 1)[0], []).append(name)
    order = random.Random(0)
    for index in range(1 + args.rounds):
        rows = list(units.values())
        order.shuffle(rows)  # no row always follows the same one
        for row in rows:
            order.shuffle(row)  # nor one contender the other
            for name in row:
                step, divisor = steps[name]
                elapsed = step()
                if index:
                    samples[name].append(elapsed / divisor)
    return samples


OP_CALLS = (100, 4000)
OP_PATHS = {"host path, copied": True, "host path, by reference": False}


def compute_ops(calls: int, copy: bool) -> int:
    """Torch ops of one ``compute()`` after ``calls`` log calls of the mixed step."""
    gen = torch.Generator().manual_seed(0)
    tracker = Tracker()
    tracker.copy_cpu_tensors = copy
    for i in range(calls // 4):
        x, mask = torch.randn(1000, generator=gen), torch.rand(1000, generator=gen) > 0.3
        tracker.mean("masked", x, weight=mask)
        tracker.mean("scalar", torch.tensor(float(i)))
        tracker.mean("float", 0.5 * i)
        tracker.max("max", x)
    return count_ops(lambda: tracker.compute(sync=False)).total


def op_table() -> list[str]:
    """compute()'s torch ops after ``OP_CALLS`` calls, per path."""
    rows = [
        "| log calls take | "
        + " | ".join(f"ops after {calls:,} calls" for calls in OP_CALLS)
        + " | same count |",
        "|---|" + "---:|" * len(OP_CALLS) + "---|",
    ]
    for path, copy in OP_PATHS.items():
        counts = [compute_ops(calls, copy) for calls in OP_CALLS]
        same = "yes" if len(set(counts)) == 1 else "no"
        rows.append(f"| {path} | " + " | ".join(map(str, counts)) + f" | {same} |")
    return rows


def markdown(samples: dict[str, list[float]], args: argparse.Namespace) -> list[str]:
    """The table: per row the medians, the ratio to the eager way or the target, met."""
    med = {name: statistics.median(xs) for name, xs in samples.items()}
    rows = [
        "| row | rlmetrics | eager (verl-style) | rlmetrics / eager | target | met |",
        "|---|---:|---:|---:|---|---|",
    ]
    for calls in args.calls:
        for case in CASES:
            for condition in CONDITIONS:
                row = f"{calls} calls {case} {condition}"
                mine, eager = med[f"{row} rlmetrics"], med[f"{row} eager"]
                pairs = zip(samples[f"{row} rlmetrics"], samples[f"{row} eager"], strict=True)
                ratio = statistics.median(a / b for a, b in pairs)
                met = "yes, stretch too" if ratio <= 0.5 else "yes" if ratio <= 1 else "no"
                rows.append(
                    f"| {calls} calls, {CASE_NAMES[case]}, {condition}, µs per call "
                    f"| {mine:.2f} | {eager:.2f} | {ratio:.2f} | <= 1.00 (stretch 0.50) | {met} |"
                )
    for kind in KINDS:
        ns = med[f"{kind} rlmetrics"]
        met = "yes" if ns <= NS_PER_ELEMENT else "no"
        rows.append(
            f"| {kind}, ns per element | {ns:.2f} | - | - | <= {NS_PER_ELEMENT:.0f} | {met} |"
        )
    us = med["compute rlmetrics"]
    met = "yes" if us <= COMPUTE_US else "no"
    rows.append(f"| compute of 8 metrics, µs | {us:.1f} | - | - | <= {COMPUTE_US:.0f} | {met} |")
    rows += [
        "",
        f"Steps of {' and '.join(map(str, args.calls))} calls of {args.elements} float32 "
        f"elements with a bool mask: fresh tensors over {args.metrics} mean metrics, fresh "
        "tensors to one mean metric, or one tensor and mask logged every call to one mean "
        "metric (the last two against issue 44's eager way, see the script); one call of "
        f"{args.big} elements per kind; caches evicted by a pass over {args.evict} MB; "
        f"medians of {args.rounds} rounds, thread time. The ratio is the median over the "
        "rounds of each round's rlmetrics / eager: a round runs a row's two contenders "
        "back to back, in a random order, so the machine's drifts in speed hit both.",
    ]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--calls", type=int, nargs="+", default=[200, 3000])
    parser.add_argument("--elements", type=int, default=1000)
    parser.add_argument("--metrics", type=int, default=8)
    parser.add_argument("--big", type=int, default=4_000_000)
    parser.add_argument("--evict", type=int, default=64, help="MB the eviction pass covers")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    before = load()
    samples = run(args)
    loads = (before, load())
    text = "\n".join(
        [
            START,
            "## fold_bench: a step's log calls and compute() on the host, against the eager "
            "way (`benchmarks/fold_bench.py`)",
            "",
            f"Machine: {machine('torch threads 1', loads)}.",
            "",
            *markdown(samples, args),
            "",
            "Torch ops one `compute()` dispatches after 100 and 4,000 log calls of 4 metrics "
            "in turn (a 1k float32 tensor with a bool mask, a 0-d tensor, a python float, a "
            "1k tensor to a max), host path; target: the same count:",
            "",
            *op_table(),
            END,
        ]
    )
    print(text)
    if not args.no_write:
        write_section(text, START, END)


if __name__ == "__main__":
    main()
