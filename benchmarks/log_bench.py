"""Benchmark the cost of one log call: rlmetrics vs torchmetrics vs a verl-style list append.

Run from the repository root (about half a minute on 2 cores):

    .venv/bin/python benchmarks/log_bench.py

Options: ``--rounds 60``, ``--calls 2000`` (calls per timed batch for scalar inputs; a
tenth of it for the 1k-element input), ``--threads 1`` (torch intra-op threads),
``--no-write`` (print only). By default the table is written into
``benchmarks/RESULTS.md`` between the ``log_bench`` markers; the rest of that file is
kept as it is.

Inputs (CPU): a python float, a 0-d float32 tensor, and a 1k-element float32 tensor with
a bool mask: the same mask every call (as many metrics of one micro-batch share its
response mask) and, untargeted, a new mask each call (the next of 64, in turn; fetching
it costs every contender the same). Contenders, each given the input the way its users
pass it:

* rlmetrics: ``Tracker.mean(name, value, weight=mask)`` (host data takes the host path);
* rlmetrics tensor path: the same call with ``Tracker.reduce_host_data_with_numpy = False`` and
  ``copy_cpu_tensors = False``, which send CPU tensors down the path a CUDA tensor
  takes, recorded by reference (on a GPU its torch ops run asynchronously; their host
  cost is the dispatch measured here);
* torchmetrics: ``MeanMetric.update(value, weight=mask)``;
* verl-style: ``metrics[name].append(value.item() if tensor)``, and for the masked input
  the masked mean first (``(x * mask).sum() / mask.sum()``), as verl's loss helpers do.

A timed batch is ``calls`` back-to-back calls of one contender on one input, timed with
``time.perf_counter_ns``; its per-call mean is one sample. Every round runs one batch of
each (contender, input) pair, in a shuffled order, so drift hits all of them alike. The
table reports the median sample per pair after one untimed warm-up round. On CPU,
``.item()`` costs no device sync: on a GPU the verl-style column would also wait for the
device on every call, which rlmetrics never does.

A second table counts the torch ops each log call dispatches (``op_count.OpCounter``, a
``TorchDispatchMode``): the mean over ``OP_CALLS`` calls after one uncounted call. The
targets (issue 18) are checked for rlmetrics on the python float, the 0-d tensor and
the masked 1k tensor, and for the tensor path on the masked 1k tensor: at most 1 µs per
call, and no torch op dispatched. Only the public API is used (log calls, ``reset``),
so the script runs on any version of the tracker.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from collections.abc import Callable

import torch

from rlmetrics import Tracker

from op_count import count_ops, describe
from results_md import load, machine, write_section

START, END = "<!-- log_bench:start -->", "<!-- log_bench:end -->"
CONTENDERS = ("rlmetrics", "rlmetrics tensor path", "torchmetrics", "verl-style")
INPUTS = ("python float", "0-d tensor", "1k tensor + bool mask", "1k tensor + new bool mask")
FRESH_MASKS = 64  # the masks the last input takes in turn
TARGET_NS = 1000  # per log call, each of TARGETS
TARGET_OPS = 0  # torch ops dispatched per log call, each of TARGETS
TARGETS = (*((CONTENDERS[0], label) for label in INPUTS[:3]), (CONTENDERS[1], INPUTS[2]))
OP_CALLS = 100  # calls whose dispatched ops are counted, per (contender, input)

Call = Callable[[], None]


def make_calls() -> dict[tuple[str, str], tuple[Call, Call]]:
    """(contender, input) -> (one log call, a reset run between batches, untimed)."""
    from torchmetrics import MeanMetric

    scalar = 0.73
    zero_d = torch.tensor(0.73)
    values = torch.randn(1000)
    mask = torch.rand(1000) > 0.3
    inputs = {"python float": (scalar, None), "0-d tensor": (zero_d, None)}
    inputs["1k tensor + bool mask"] = (values, mask)
    masks = [torch.rand(1000) > 0.3 for _ in range(FRESH_MASKS)]
    if not hasattr(Tracker, "reduce_host_data_with_numpy"):  # setting it would pass silently
        raise RuntimeError(
            "Tracker.reduce_host_data_with_numpy is gone: the tensor path needs another switch"
        )
    calls: dict[tuple[str, str], tuple[Call, Call]] = {}
    for label, (value, weight) in inputs.items():
        for contender in CONTENDERS[:2]:
            tracker = Tracker()
            tracker.reduce_host_data_with_numpy = tracker.copy_cpu_tensors = (
                contender == "rlmetrics"
            )
            calls[contender, label] = (
                (lambda t=tracker, v=value: t.mean("loss", v))
                if weight is None
                else (lambda t=tracker, v=value, w=weight: t.mean("loss", v, weight=w)),
                tracker.reset,
            )
        metric = MeanMetric()
        calls["torchmetrics", label] = (
            (lambda m=metric, v=value: m.update(v))
            if weight is None
            else (lambda m=metric, v=value, w=weight: m.update(v, weight=w)),
            metric.reset,
        )
        store: dict[str, list[float]] = {}
        calls["verl-style", label] = (verl_call(store, value, weight), store.clear)
    add_fresh_mask_calls(calls, values, masks)
    return calls


def add_fresh_mask_calls(
    calls: dict[tuple[str, str], tuple[Call, Call]], values: torch.Tensor, masks: list[torch.Tensor]
) -> None:
    """The last input's calls: each contender's masked call, the next mask each time."""
    from torchmetrics import MeanMetric

    label = INPUTS[3]
    for contender in CONTENDERS[:2]:
        tracker = Tracker()
        tracker.reduce_host_data_with_numpy = tracker.copy_cpu_tensors = contender == "rlmetrics"
        tracker_masks = itertools.cycle(masks)
        calls[contender, label] = (
            lambda t=tracker, ws=tracker_masks: t.mean("loss", values, weight=next(ws)),
            tracker.reset,
        )
    metric, metric_masks = MeanMetric(), itertools.cycle(masks)
    calls["torchmetrics", label] = (
        lambda m=metric, ws=metric_masks: m.update(values, weight=next(ws)),
        metric.reset,
    )
    store: dict[str, list[float]] = {}
    verl_masked = itertools.cycle([verl_call(store, values, mask) for mask in masks])
    calls["verl-style", label] = (lambda: next(verl_masked)(), store.clear)


def verl_call(store: dict[str, list[float]], value: object, mask: torch.Tensor | None) -> Call:
    """verl's pattern: reduce to a python float now (``.item()``), append to a list."""
    if mask is not None:
        assert isinstance(value, torch.Tensor)

        def masked() -> None:
            mean = (value * mask).sum() / mask.sum()
            store.setdefault("loss", []).append(mean.item())

        return masked

    def plain() -> None:
        item = value.item() if isinstance(value, torch.Tensor) else value
        store.setdefault("loss", []).append(item)

    return plain


def time_batch(call: Call, calls: int) -> float:
    """Mean ns per call over ``calls`` back-to-back calls."""
    start = time.perf_counter_ns()
    for _ in range(calls):
        call()
    return (time.perf_counter_ns() - start) / calls


def run(rounds: int, calls: int, seed: int) -> dict[tuple[str, str], list[float]]:
    """Per-batch mean ns per call, for every (contender, input), rounds interleaved."""
    table = make_calls()
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in table}
    order = list(table)
    rnd = random.Random(seed)
    for round_index in range(rounds + 1):  # round 0 warms up
        rnd.shuffle(order)
        for key in order:
            call, reset = table[key]
            n = calls if not key[1].startswith("1k") else max(calls // 10, 1)
            sample = time_batch(call, n)
            reset()
            if round_index:
                samples[key].append(sample)
    return samples


def op_counts() -> dict[tuple[str, str], tuple[float, str]]:
    """(contender, input) -> (torch ops per log call, the ops by name): the mean over
    ``OP_CALLS`` calls after one uncounted call (a name's first call may set it up)."""
    counts: dict[tuple[str, str], tuple[float, str]] = {}
    for key, (call, reset) in make_calls().items():
        call()
        counter = count_ops(call, OP_CALLS)
        reset()
        counts[key] = (counter.total / OP_CALLS, describe(counter, OP_CALLS))
    return counts


def markdown(samples: dict[tuple[str, str], list[float]]) -> list[str]:
    """The timing table: medians in µs, and each contender's ratio to rlmetrics."""
    rows = [
        "| input | "
        + " | ".join(f"{c} µs" for c in CONTENDERS)
        + " | "
        + " | ".join(f"{c} / rl" for c in CONTENDERS[1:])
        + " |",
        "|---|" + "---:|" * (2 * len(CONTENDERS) - 1),
    ]
    for label in INPUTS:
        med = {c: statistics.median(samples[c, label]) for c in CONTENDERS}
        cells = " | ".join(f"{med[c] / 1000:.2f}" for c in CONTENDERS)
        ratios = " | ".join(f"{med[c] / med['rlmetrics']:.2f}x" for c in CONTENDERS[1:])
        rows.append(f"| {label} | {cells} | {ratios} |")
    return rows


def ops_markdown(counts: dict[tuple[str, str], tuple[float, str]]) -> list[str]:
    """The op-count table (ops per call), then the rlmetrics ops by name where any."""
    rows = [
        "| input | " + " | ".join(f"{c} ops" for c in CONTENDERS) + " |",
        "|---|" + "---:|" * len(CONTENDERS),
    ]
    for label in INPUTS:
        rows.append(
            f"| {label} | " + " | ".join(f"{counts[c, label][0]:g}" for c in CONTENDERS) + " |"
        )
    named = [
        f"- {c}, {label}: {counts[c, label][1]}"
        for c in CONTENDERS[:2]
        for label in INPUTS
        if counts[c, label][0]
    ]
    return rows + (["", *named] if named else [])


def verdict(
    samples: dict[tuple[str, str], list[float]], counts: dict[tuple[str, str], tuple[float, str]]
) -> list[str]:
    """One line per target case: its median time and op count, each met or not met."""
    lines = []
    for contender, label in TARGETS:
        ns = statistics.median(samples[contender, label])
        ops = counts[contender, label][0]
        lines.append(
            f"- {contender}, {label}: {ns / 1000:.2f} µs per call, "
            f"{'met' if ns <= TARGET_NS else 'not met'} (≤ {TARGET_NS / 1000:g} µs); "
            f"{ops:g} torch ops per call, "
            f"{'met' if ops <= TARGET_OPS else 'not met'} ({TARGET_OPS})."
        )
    return lines


def machine_line(threads: int, loads: tuple[str, str]) -> str:
    """Where the numbers come from (``results_md.machine``)."""
    import torchmetrics

    return machine(f"torchmetrics {torchmetrics.__version__}, torch threads {threads}", loads)


def section(parts: dict[str, list[str]], args: argparse.Namespace, loads: tuple[str, str]) -> str:
    """The whole marked section of RESULTS.md."""
    return "\n".join(
        [
            START,
            "## log_bench: cost of one log call (`benchmarks/log_bench.py`)",
            "",
            "The host cost of one log call and the torch ops it dispatches: rlmetrics "
            "(host path and tensor path) against torchmetrics and a verl-style list "
            "append, CPU inputs.",
            "",
            f"Machine: {machine_line(args.threads, loads)}. Settings: `--rounds "
            f"{args.rounds} --calls {args.calls}`.",
            "",
            f"µs per call: the median over {args.rounds} rounds of a batch's mean, "
            "contenders and inputs shuffled each round (`.item()` syncs no device here, so "
            "verl-style is a lower bound of its GPU cost):",
            "",
            *parts["times"],
            "",
            f"Torch ops per log call (a `TorchDispatchMode`, mean over {OP_CALLS} calls):",
            "",
            *parts["ops"],
            "",
            "Targets (issue 18), per log call:",
            "",
            *parts["verdict"],
            END,
        ]
    )


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark, print the tables, write RESULTS.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start, before = time.perf_counter(), load()
    samples = run(args.rounds, args.calls, args.seed)
    counts = op_counts()
    loads = (before, load())
    parts = {
        "times": markdown(samples),
        "ops": ops_markdown(counts),
        "verdict": verdict(samples, counts),
    }
    for rows in parts.values():
        print("\n".join(rows))
    print(f"load average {loads[0]} before, {loads[1]} after")
    print(f"total {time.perf_counter() - start:.0f} s")
    if not args.no_write:
        write_section(section(parts, args, loads), START, END)


if __name__ == "__main__":
    main()
