"""Benchmark the share of a training step spent logging and computing metrics.

Run from the repository root (about three minutes on 2 shared cores):

    .venv/bin/python benchmarks/step_share.py

Options: ``--steps 300`` (demo steps, defaults otherwise), ``--warmup 6`` (steps left
out of the statistics), ``--dp 2``, ``--n-embd``/``--n-layer`` (another model size),
``--no-write`` (print only). By default the result is written into
``benchmarks/RESULTS.md`` between the ``step_share`` markers; the rest of that file is
kept as it is.

The demo trainer (``rlmetrics demo`` defaults: GRPO, 32 prompts x 8 samples, float32)
runs on ``--dp`` spawned gloo ranks with these patches, installed in each rank:

* the Tracker's log methods of each kind (``Tracker.mean`` and the others),
  ``Tracker._log`` and ``Tracker._log_shared`` (every log call of a Tracker or a
  prefixed view goes through one of them) and ``Tracker.compute`` are wrapped in a
  ``perf_counter`` timer that adds to per-step totals;
* ``train_step`` is wrapped the same way: its wall time is the step (it ends with the
  step's ``compute()``);
* before ``compute()``, an untimed ``dist.barrier()`` aligns the ranks, so that waiting
  for the slower rank (load imbalance, which the next collective would absorb anyway)
  is not booked as the sync's cost; its time is left out of the step as well;
* on odd steps the tracker is switched off inside those timers: log calls return at
  once and ``compute()`` resets and returns the previous step's dict (no collective);
* rank 0's ``Reporter.log`` (console, JSONL) is timed too; it runs between steps and is
  reported separately, outside the share.

Two readings of the metrics' cost come out of one run. Time inside the calls (steps
with the tracker on): the timer's own cost, measured on each rank by wrapping a no-op,
is subtracted from the log total (the part inside a timed interval, per call) and from
the step time (its whole cost, per call); share = (log + compute) / step, per step, and
the table gives medians. What the metrics add (A/B, both arms run the same timers):
the median step time with the tracker on minus with it off, and the sum over the
step's parts (trainer phases, ``compute()``, the rest) of their median differences,
each with a bootstrap interval; these also catch costs paid outside the calls.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import functools
import importlib
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from results_md import load, machine, write_section

START, END = "<!-- step_share:start -->", "<!-- step_share:end -->"
TARGET = 0.01
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # cpu: all threads
PHASES = ("rollout", "prepare", "log_batch", "optimize")  # functions of trainer/train.py
KIND_METHODS = ("mean", "sum", "max", "min", "std", "last", "dist", "quantile")
COUNTERS = ("log", "compute", "wait", "step", "report", *PHASES)


def fresh_totals() -> dict[str, float]:
    """Zeroed per-step totals: ``<counter>:<clock>`` seconds, and ``log_calls``."""
    return {f"{c}:{k}": 0.0 for c in COUNTERS for k in CLOCKS} | {"log_calls": 0.0}


def timed(
    fn: Callable,
    totals: dict[str, float],
    name: str,
    count: bool = False,
    depth: list[int] | None = None,
) -> Callable:
    """``fn`` that adds its wall and process CPU time to ``totals[name:wall|cpu]``.

    Wrappers sharing a ``depth`` cell time only the outermost call (``log_shared``
    calls ``_log`` once per metric: its time is booked once, as one call).
    """
    wall, cpu = CLOCKS["wall"], CLOCKS["cpu"]
    depth = [0] if depth is None else depth

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if depth[0]:
            return fn(*args, **kwargs)
        depth[0] += 1
        w, c = wall(), cpu()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[f"{name}:cpu"] += cpu() - c
            totals[f"{name}:wall"] += wall() - w
            depth[0] -= 1
            if count:
                totals["log_calls"] += 1

    return wrapper


def timer_overhead(n: int = 100_000) -> dict[str, float]:
    """Seconds per call the timer adds, per clock: inside the timed interval
    (``inside:<clock>``) and in all (``whole:<clock>``); the minimum of 5 rounds."""

    def noop(_self: Any, *_args: Any) -> None:
        return None

    totals = fresh_totals()
    wrapped = timed(noop, totals, "log")
    rounds: dict[str, list[float]] = {}
    for _ in range(5):
        totals.update(fresh_totals())
        t0 = {k: clock() for k, clock in CLOCKS.items()}
        for _ in range(n):
            noop(None, 1)
        t1 = {k: clock() for k, clock in CLOCKS.items()}
        for _ in range(n):
            wrapped(None, 1)
        t2 = {k: clock() for k, clock in CLOCKS.items()}
        for k in CLOCKS:
            rounds.setdefault(f"inside:{k}", []).append(totals[f"log:{k}"] / n)
            whole = ((t2[k] - t1[k]) - (t1[k] - t0[k])) / n
            rounds.setdefault(f"whole:{k}", []).append(whole)
    return {key: max(0.0, min(values)) for key, values in rounds.items()}


def aligned(compute: Callable, totals: dict[str, float]) -> Callable:
    """``compute`` after a barrier timed apart: waiting for a slower rank is not its cost."""

    def barrier(group: Any = None) -> None:
        tdist.barrier(group=group)

    wait = timed(barrier, totals, "wait")

    @functools.wraps(compute)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        wait(kwargs.get("group"))
        return compute(self, *args, **kwargs)

    return wrapper


def switchable(
    logs: tuple[Callable, ...], compute: Callable
) -> tuple[list[Callable], Callable, dict]:
    """The log methods and ``Tracker.compute``, doing nothing while ``switch["on"]`` is
    False (compute then resets and returns the last real metrics, so the loggers still
    get a dict); the switch is flipped between steps, the same on every rank."""
    switch: dict[str, Any] = {"on": True, "last": {}}

    def switched(log: Callable) -> Callable:
        def switched_log(self: Any, *args: Any, **kwargs: Any) -> None:
            if switch["on"]:
                log(self, *args, **kwargs)

        return switched_log

    def switched_compute(self: Any, *args: Any, **kwargs: Any) -> dict[str, float]:
        if switch["on"]:
            switch["last"] = compute(self, *args, **kwargs)
        else:
            self.reset()
        return dict(switch["last"])

    return [switched(log) for log in logs], switched_compute, switch


def install(rank: int, steps: list[dict[str, float]], alternate: bool) -> None:
    """Patch the tracker, train_step and the reporter; one dict per step into ``steps``.

    With ``alternate``, odd steps run with the tracker switched off (log calls and
    ``compute()`` return at once, inside the same timers), for the A/B comparison.
    """
    from rlmetrics.tracker import Tracker
    from rlmetrics.trainer import report

    train = importlib.import_module("rlmetrics.trainer.train")  # the package shadows it

    totals = fresh_totals()
    names = ("_log", "_log_shared", *KIND_METHODS)
    logs, compute, switch = switchable(tuple(getattr(Tracker, n) for n in names), Tracker.compute)
    depth = [0]  # one cell: a log_shared call is timed once, not again per metric
    for name, log in zip(names, logs, strict=True):
        setattr(Tracker, name, timed(log, totals, "log", count=True, depth=depth))
    Tracker.compute = aligned(timed(compute, totals, "compute"), totals)
    report.Reporter.log = timed(report.Reporter.log, totals, "report")
    inner = timed(train.train_step, totals, "step")
    for phase in PHASES:
        setattr(train, phase, timed(getattr(train, phase), totals, phase))

    def train_step(r: Any, step: int, *args: Any, **kwargs: Any) -> dict[str, float]:
        if steps:  # the reporter ran after the previous step: book it there
            for k in CLOCKS:
                steps[-1][f"report:{k}"] += totals[f"report:{k}"]
        totals.update(fresh_totals())
        switch["on"] = not alternate or step % 2 == 0
        metrics = inner(r, step, *args, **kwargs)
        steps.append(dict(totals) | {"on": float(switch["on"])})
        return metrics

    train.train_step = train_step


def _rank(rank: int, world: int, port: int, cfg: Any, out: str, alternate: bool) -> None:
    """One spawned rank: calibrate the timer, train with the patches, save the steps."""
    from datetime import timedelta

    from rlmetrics.trainer import train

    torch.set_num_threads(1)
    overhead = timer_overhead()
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))  # fmt: skip
    steps: list[dict[str, float]] = []
    try:
        install(rank, steps, alternate)
        train(cfg, rank, world)
        tdist.barrier()
    finally:
        tdist.destroy_process_group()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps((overhead, steps)))


def run(
    steps: int, dp: int, run_dir: str, model: dict[str, int] | None = None, alternate: bool = True
) -> list[tuple[tuple[float, float], list[dict]]]:
    """Train the demo for ``steps`` steps on ``dp`` ranks; per rank (overhead, steps)."""
    from rlmetrics.trainer.config import TrainConfig
    from rlmetrics.trainer.launch import free_port

    cfg = TrainConfig()
    cfg = replace(cfg, run=replace(cfg.run, steps=steps, dp=dp, run_dir=run_dir, progress=False))
    if model:
        cfg = replace(cfg, model=replace(cfg.model, **model))
    with tempfile.TemporaryDirectory(prefix="step-share-") as tmp:
        mp.spawn(_rank, args=(dp, free_port(), cfg, tmp, alternate), nprocs=dp)
        return [pickle.loads(Path(tmp, f"rank{r}.pkl").read_bytes()) for r in range(dp)]


def summarize(overhead: dict[str, float], steps: list[dict[str, float]], clock: str) -> dict:
    """Medians over steps of one clock's corrected times (seconds) and of the share."""
    inside, whole = overhead[f"inside:{clock}"], overhead[f"whole:{clock}"]
    rows = []
    for s in steps:
        calls = s["log_calls"] + 2  # + compute() and the barrier
        log = max(0.0, s[f"log:{clock}"] - s["log_calls"] * inside)
        compute = max(0.0, s[f"compute:{clock}"] - inside)
        step = s[f"step:{clock}"] - s[f"wait:{clock}"] - calls * whole
        rows.append({"log": log, "compute": compute, "step": step, "calls": s["log_calls"],
                     "share": (log + compute) / step, "report": s[f"report:{clock}"],
                     "wait": s[f"wait:{clock}"]})  # fmt: skip
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    med["total_share"] = sum(r["log"] + r["compute"] for r in rows) / sum(r["step"] for r in rows)
    med["inside_us"], med["whole_us"] = inside * 1e6, whole * 1e6
    return med


def components(s: dict[str, float], clock: str) -> list[float]:
    """One step's time in parts that add up to it (barrier wait left out): the trainer's
    phases, ``compute()``, and the rest."""
    parts = [s[f"{phase}:{clock}"] for phase in PHASES] + [s[f"compute:{clock}"]]
    return [*parts, s[f"step:{clock}"] - s[f"wait:{clock}"] - sum(parts)]


def ab_added(steps: list[dict[str, float]], clock: str, seed: int = 0) -> dict[str, float]:
    """What the tracker adds to a step, two ways, each with a 90% bootstrap interval:
    the median step time on minus off, and the sum over the step's parts of their
    median on minus off (the parts vary less than the whole, so this is tighter)."""
    arms = {arm: np.array([components(s, clock) for s in steps if s["on"] == arm])
            for arm in (1.0, 0.0)}  # fmt: skip
    on, off = arms[1.0], arms[0.0]

    def estimates(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
        whole = np.median(a.sum(1)) - np.median(b.sum(1))
        return whole, float((np.median(a, 0) - np.median(b, 0)).sum())

    rng = np.random.default_rng(seed)
    boot = np.array([estimates(on[rng.integers(0, len(on), len(on))],
                               off[rng.integers(0, len(off), len(off))])
                     for _ in range(2000)])  # fmt: skip
    (low, parts_low), (high, parts_high) = np.quantile(boot, [0.05, 0.95], axis=0)
    med_on, med_off = float(np.median(on.sum(1))), float(np.median(off.sum(1)))
    added, by_parts = estimates(on, off)
    return {"on": med_on, "off": med_off, "added": added, "share": added / med_off,
            "low": low / med_off, "high": high / med_off, "n_on": len(on), "n_off": len(off),
            "parts": by_parts, "parts_share": by_parts / med_off,
            "parts_low": parts_low / med_off, "parts_high": parts_high / med_off}  # fmt: skip


def rank_rows(
    per_rank: list[dict[str, dict]], header: str, cells: Callable[[dict], str]
) -> list[str]:
    """A markdown table with one row per rank and clock: ``| rank | clock | cells |``."""
    align = "|---:|---|" + "---:|" * (header.count("|") + 1)
    rows = [f"| rank | clock | {header} |", align]
    for rank, clocks in enumerate(per_rank):
        rows += [f"| {rank} | {clock} | {cells(m)} |" for clock, m in clocks.items()]
    return rows


def ab_table(per_rank: list[dict[str, dict]]) -> list[str]:
    """Markdown rows of the A/B comparison, one per rank and clock."""
    header = (
        "steps on / off | step ms, metrics on | step ms, metrics off | added ms (whole step) "
        "| share | 90% interval | added ms (sum of parts) | share | 90% interval"
    )
    return rank_rows(per_rank, header, lambda m: (
        f"{m['n_on']} / {m['n_off']} | {m['on'] * 1e3:.1f} | {m['off'] * 1e3:.1f} | "
        f"{m['added'] * 1e3:.2f} | {m['share']:.2%} | {m['low']:.2%} to {m['high']:.2%} | "
        f"{m['parts'] * 1e3:.2f} | {m['parts_share']:.2%} | "
        f"{m['parts_low']:.2%} to {m['parts_high']:.2%}"
    ))  # fmt: skip


def table(per_rank: list[dict[str, dict]]) -> list[str]:
    """Markdown rows of the time inside the calls, one per rank and clock."""
    header = (
        "step ms | log calls | log ms | compute() ms | metrics share (median) | share of "
        "summed time | barrier wait ms | timer µs/call (inside / total)"
    )
    return rank_rows(per_rank, header, lambda m: (
        f"{m['step'] * 1e3:.1f} | {m['calls']:.0f} | {m['log'] * 1e3:.2f} | "
        f"{m['compute'] * 1e3:.2f} | {m['share']:.2%} | {m['total_share']:.2%} | "
        f"{m['wait'] * 1e3:.2f} | {m['inside_us']:.2f} / {m['whole_us']:.2f}"
    ))  # fmt: skip


def section(
    rows: list[str], ab_rows: list[str], args: argparse.Namespace, worst: dict, loads: tuple
) -> str:
    """The whole marked section of RESULTS.md."""
    met = {k: "met" if v <= TARGET else "missed" for k, v in worst.items()}
    model = f" --n-embd {args.n_embd}" if args.n_embd else ""
    model += f" --n-layer {args.n_layer}" if args.n_layer else ""
    return "\n".join([
        START,
        "## step_share: metrics' share of a training step (`benchmarks/step_share.py`)",
        "",
        "The metrics' cost in `rlmetrics demo`'s GRPO training step on gloo ranks: time "
        "inside the log calls and `compute()`, and the step with the tracker on against "
        "off (alternate steps), as a share of the step.",
        "",
        f"Machine: {machine('gloo on 127.0.0.1, one torch thread per rank', loads)}. "
        f"Settings: `--steps {args.steps} --warmup {args.warmup} --dp {args.dp}{model}`.",
        "",
        "Time inside the calls (steps with the tracker on, timer cost subtracted; "
        "medians per step; the barrier before `compute()` left out):",
        "",
        *rows,
        "",
        "What the metrics add (on minus off: the whole step's medians, and the sum of "
        "each phase's medians; 90% intervals bootstrapped over steps):",
        "",
        *ab_rows,
        "",
        f"Target ≤ {TARGET:.0%} of a step, worst rank: time inside the calls "
        f"{worst['wall']:.2%} wall ({met['wall']}), {worst['cpu']:.2%} CPU ({met['cpu']}); "
        f"added (sum of parts) {worst['parts_wall']:.2%} wall ({met['parts_wall']}), "
        f"{worst['parts_cpu']:.2%} CPU ({met['parts_cpu']}); added (whole step) "
        f"{worst['ab_wall']:.2%} wall ({met['ab_wall']}), {worst['ab_cpu']:.2%} CPU "
        f"({met['ab_cpu']}).",
        END,
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark, print the table, write RESULTS.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--n-embd", type=int, default=None, help="model width (default: demo's)")
    parser.add_argument("--n-layer", type=int, default=None, help="model depth (default: demo's)")
    args = parser.parse_args(argv)
    before = load()
    with tempfile.TemporaryDirectory(prefix="step-share-run-") as run_dir:
        model = {k: v for k, v in (("n_embd", args.n_embd), ("n_layer", args.n_layer)) if v}
        results = run(args.steps, args.dp, run_dir, model)
    per_rank, ab = [], []
    for overhead, steps in results:
        measured = steps[args.warmup :]
        on = [s for s in measured if s["on"]]
        per_rank.append({clock: summarize(overhead, on, clock) for clock in CLOCKS})
        ab.append({clock: ab_added(measured, clock) for clock in CLOCKS})
    worst = {clock: max(m[clock]["share"] for m in per_rank) for clock in CLOCKS}
    worst |= {f"ab_{clock}": max(m[clock]["share"] for m in ab) for clock in CLOCKS}
    worst |= {f"parts_{clock}": max(m[clock]["parts_share"] for m in ab) for clock in CLOCKS}
    text = section(table(per_rank), ab_table(ab), args, worst, (before, load()))
    print(text)
    if not args.no_write:
        write_section(text, START, END)


if __name__ == "__main__":
    main()
