"""Benchmark the share of a training step spent logging and computing metrics.

Run from the repository root (about a minute on 2 shared cores):

    .venv/bin/python benchmarks/step_share.py

Options: ``--steps 40`` (demo steps, defaults otherwise), ``--warmup 5`` (steps left
out of the statistics), ``--dp 2``, ``--no-write`` (print only). By default the result
is written into ``benchmarks/RESULTS.md`` between the ``step_share`` markers; the rest
of that file is kept as it is.

The demo trainer (``rlmetrics demo`` defaults: GRPO, 32 prompts x 8 samples, float32)
runs on ``--dp`` spawned gloo ranks with three patches, installed in each rank:

* ``Tracker._log`` (every log call of a Tracker or a prefixed view ends there) and
  ``Tracker.compute`` are wrapped in a ``perf_counter`` timer that adds to per-step
  totals;
* ``train_step`` is wrapped the same way: its wall time is the step (it ends with the
  step's ``compute()``);
* before ``compute()``, an untimed ``dist.barrier()`` aligns the ranks, so that waiting
  for the slower rank (load imbalance, which the next collective would absorb anyway)
  is not booked as the sync's cost; its time is left out of the step as well;
* rank 0's ``Reporter.log`` (console, JSONL) is timed too; it runs between steps and is
  reported separately, outside the share.

The timer's own cost is measured on each rank by wrapping a no-op: the time it adds
*inside* a timed interval is subtracted from the log total (per call), and its whole
cost is subtracted from the step time (per call). share = (log + compute) / step, per
step; the table gives medians over the measured steps, per rank.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import datetime
import functools
import importlib
import pickle
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from results_md import write_section

START, END = "<!-- step_share:start -->", "<!-- step_share:end -->"
TARGET = 0.01
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # cpu: all threads
COUNTERS = ("log", "compute", "wait", "step", "report")


def fresh_totals() -> dict[str, float]:
    """Zeroed per-step totals: ``<counter>:<clock>`` seconds, and ``log_calls``."""
    return {f"{c}:{k}": 0.0 for c in COUNTERS for k in CLOCKS} | {"log_calls": 0.0}


def timed(fn: Callable, totals: dict[str, float], name: str, count: bool = False) -> Callable:
    """``fn`` that adds its wall and process CPU time to ``totals[name:wall|cpu]``."""
    wall, cpu = CLOCKS["wall"], CLOCKS["cpu"]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        w, c = wall(), cpu()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[f"{name}:cpu"] += cpu() - c
            totals[f"{name}:wall"] += wall() - w
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
        dist.barrier(group=group)

    wait = timed(barrier, totals, "wait")

    @functools.wraps(compute)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        wait(kwargs.get("group"))
        return compute(self, *args, **kwargs)

    return wrapper


def install(rank: int, steps: list[dict[str, float]]) -> None:
    """Patch the tracker, train_step and the reporter; one dict per step into ``steps``."""
    from rlmetrics.tracker import Tracker
    from rlmetrics.trainer import report

    train = importlib.import_module("rlmetrics.trainer.train")  # the package shadows it

    totals = fresh_totals()
    Tracker._log = timed(Tracker._log, totals, "log", count=True)
    Tracker.compute = aligned(timed(Tracker.compute, totals, "compute"), totals)
    report.Reporter.log = timed(report.Reporter.log, totals, "report")
    inner = timed(train.train_step, totals, "step")

    def train_step(*args: Any, **kwargs: Any) -> dict[str, float]:
        if steps:  # the reporter ran after the previous step: book it there
            for k in CLOCKS:
                steps[-1][f"report:{k}"] += totals[f"report:{k}"]
        totals.update(fresh_totals())
        metrics = inner(*args, **kwargs)
        steps.append(dict(totals))
        return metrics

    train.train_step = train_step


def _rank(rank: int, world: int, port: int, cfg: Any, out: str) -> None:
    """One spawned rank: calibrate the timer, train with the patches, save the steps."""
    from datetime import timedelta

    from rlmetrics.trainer import train

    torch.set_num_threads(1)
    overhead = timer_overhead()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))  # fmt: skip
    steps: list[dict[str, float]] = []
    try:
        install(rank, steps)
        train(cfg, rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps((overhead, steps)))


def run(
    steps: int, dp: int, run_dir: str, model: dict[str, int] | None = None
) -> list[tuple[tuple[float, float], list[dict]]]:
    """Train the demo for ``steps`` steps on ``dp`` ranks; per rank (overhead, steps)."""
    from rlmetrics.trainer.config import TrainConfig
    from rlmetrics.trainer.launch import free_port

    cfg = TrainConfig()
    cfg = replace(cfg, run=replace(cfg.run, steps=steps, dp=dp, run_dir=run_dir, progress=False))
    if model:
        cfg = replace(cfg, model=replace(cfg.model, **model))
    with tempfile.TemporaryDirectory(prefix="step-share-") as tmp:
        mp.spawn(_rank, args=(dp, free_port(), cfg, tmp), nprocs=dp)
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


def table(per_rank: list[dict[str, dict]]) -> list[str]:
    """Markdown rows, one per rank and clock."""
    rows = [
        "| rank | clock | step ms | log calls | log ms | compute() ms | metrics share (median) "
        "| share of summed time | barrier wait ms | timer µs/call (inside / total) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rank, clocks in enumerate(per_rank):
        for clock, m in clocks.items():
            rows.append(
                f"| {rank} | {clock} | {m['step'] * 1e3:.1f} | {m['calls']:.0f} | "
                f"{m['log'] * 1e3:.2f} | {m['compute'] * 1e3:.2f} | {m['share']:.2%} | "
                f"{m['total_share']:.2%} | {m['wait'] * 1e3:.2f} | "
                f"{m['inside_us']:.2f} / {m['whole_us']:.2f} |"
            )
    return rows


def machine() -> str:
    """One line describing where the numbers come from."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{os.cpu_count()} CPUs (nproc), {platform.machine()}, Python "
        f"{platform.python_version()}, torch {torch.__version__}, gloo on 127.0.0.1, one "
        f"torch thread per rank, load average {load} at the end, "
        f"{datetime.date.today().isoformat()}"
    )


def section(rows: list[str], args: argparse.Namespace, worst: dict, loggers: float) -> str:
    """The whole marked section of RESULTS.md."""
    met = {k: "met" if v <= TARGET else "missed" for k, v in worst.items()}
    return "\n".join([
        START,
        "## step_share: metrics' share of a training step (`benchmarks/step_share.py`)",
        "",
        f"Machine: {machine()}.",
        "",
        f"Run: `rlmetrics demo` defaults (GRPO, 32 prompts x 8 samples, float32, loggers "
        f"console+jsonl, no progress bar) on {args.dp} gloo ranks, {args.steps} steps, the "
        f"first {args.warmup} left out. Times are medians per step; metrics = time inside "
        "Tracker log calls + `compute()` (its packed sync included), timer cost subtracted. "
        "Each `compute()` is preceded by a barrier timed apart (the wait column, left out "
        "of the step too): waiting for the slower rank is load imbalance that the next "
        "collective would absorb anyway, not the metrics' cost. wall: `perf_counter`; cpu: "
        "process CPU time (all threads, gloo's included; time spent descheduled excluded, "
        "so far less sensitive to a shared machine). The loggers (console, JSONL) run "
        f"between steps on rank 0: median {loggers * 1e3:.2f} ms, not part of the share.",
        "",
        *rows,
        "",
        f"Target ≤ {TARGET:.0%} of a step: worst rank {worst['wall']:.2%} wall time "
        f"({met['wall']}), {worst['cpu']:.2%} CPU time ({met['cpu']}).",
        END,
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark, print the table, write RESULTS.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--n-embd", type=int, default=None, help="model width (default: demo's)")
    parser.add_argument("--n-layer", type=int, default=None, help="model depth (default: demo's)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="step-share-run-") as run_dir:
        model = {k: v for k, v in (("n_embd", args.n_embd), ("n_layer", args.n_layer)) if v}
        results = run(args.steps, args.dp, run_dir, model)
    per_rank = [{clock: summarize(overhead, steps[args.warmup :], clock) for clock in CLOCKS}
                for overhead, steps in results]  # fmt: skip
    worst = {clock: max(m[clock]["share"] for m in per_rank) for clock in CLOCKS}
    loggers = per_rank[0]["wall"]["report"]
    text = section(table(per_rank), args, worst, loggers)
    print(text)
    if not args.no_write:
        write_section(text, START, END)


if __name__ == "__main__":
    main()
