"""``rlmetrics audit``: one training step under several partitions, the metrics' spread.

Runs step 1 of the reference trainer (float64) once per partition of the batch (data-
parallel size, micro-batches by size or by a token budget), all in one launch of gloo
ranks with subgroups, and reports per metric how far each partition's value lies from
the first one's. ``--naive`` adds what a verl-style reduction of the same step would
have logged: per-micro-batch values, averaged (losses: pre-scaled, then summed), then
averaged over ranks. ``--plot`` draws the spreads.

    rlmetrics audit
    rlmetrics audit --naive --plot audit.png
    rlmetrics audit --algo ppo --partitions "1,2:mbs=2,3:tokens=30" --tol 1e-12
"""

from __future__ import annotations

import argparse
import math
import pickle
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from rlmetrics.tracker import Tracker
from rlmetrics.trainer.config import AlgoConfig, ModelConfig, RunConfig, TrainConfig
from rlmetrics.trainer.launch import exit_now

DEFAULT_PARTITIONS = "1,2:mbs=3,2:tokens=24,4:mbs=1"
MEASUREMENTS = ("timing_s/", "timing_per_token_ms/", "perf/")
LOSSES = ("actor/pg_loss", "actor/kl_loss", "actor/entropy_loss", "critic/vf_loss")
FLOOR = 1e-18  # where the plot puts a spread of exactly 0


# -- partitions -----------------------------------------------------------------------
@dataclass(frozen=True)
class Partition:
    """One way to split the step: ``dp`` ranks, micro-batches by size, tokens or whole."""

    dp: int
    micro_batch_size: int | None = None
    max_tokens: int | None = None

    @property
    def label(self) -> str:
        """Short name, e.g. ``dp2-mbs3``, ``dp2-tokens24``, ``dp1-whole``."""
        if self.micro_batch_size is not None:
            return f"dp{self.dp}-mbs{self.micro_batch_size}"
        if self.max_tokens is not None:
            return f"dp{self.dp}-tokens{self.max_tokens}"
        return f"dp{self.dp}-whole"

    def config(self, cfg: TrainConfig) -> TrainConfig:
        """``cfg`` with this partition's micro-batching and dp size."""
        algo = replace(cfg.algo, micro_batch_size=self.micro_batch_size,
                       max_tokens_per_micro_batch=self.max_tokens)  # fmt: skip
        return replace(cfg, algo=algo, run=replace(cfg.run, dp=self.dp))


def parse_partitions(text: str) -> list[Partition]:
    """``"1,2:mbs=3,2:tokens=24"`` -> partitions (``DP[:mbs=M|:tokens=T|:whole]``)."""
    out = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        dp, _, rest = item.partition(":")
        key, _, value = rest.partition("=")
        try:
            size = int(value) if value else None
            part = Partition(int(dp), *{"mbs": (size, None), "tokens": (None, size)}.get(
                key, (None, None)))  # fmt: skip
        except ValueError as err:
            raise ValueError(f"--partitions: cannot parse {item!r} ({err})") from err
        if (
            key not in ("", "whole", "mbs", "tokens")
            or part.dp < 1
            or (key and key != "whole" and not size)
        ):
            raise ValueError(f"--partitions: {item!r} is not DP[:mbs=M|:tokens=T|:whole]")
        out.append(part)
    if len(out) < 2:
        raise ValueError(f"--partitions needs at least two partitions, got {text!r}")
    return out


def audit_config(
    algo: str = "grpo",
    *,
    num_prompts: int = 7,
    samples_per_prompt: int = 3,
    mini_batches: int = 2,
    epochs: int = 2,
    seed: int = 0,
) -> TrainConfig:
    """The audited run: float64, one step, several optimizer steps (so ratios move)."""
    return TrainConfig(
        model=ModelConfig(dtype="float64"),
        algo=AlgoConfig(algo=algo, num_prompts=num_prompts, samples_per_prompt=samples_per_prompt,
                        mini_batches=mini_batches, epochs=epochs, warmup_steps=1),
        run=RunConfig(steps=1, seed=seed, loggers="", log_every=0, progress=False),
    )  # fmt: skip


# -- the naive (verl-style) reduction -------------------------------------------------
@dataclass(frozen=True)
class Call:
    """One log call's own value(s), as if it were the whole step."""

    kind: str
    opt_step: int  # optimizer steps of the name's prefix ("actor", "critic") before it
    rows: int
    values: dict[str, float]


class RecordingTracker(Tracker):
    """A Tracker that also keeps every log call's own value (Σ value·weight / Σ weight
    for means), to reduce them naively afterwards. Host syncs per call: audits only."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: list[Call] = []
        self._opt_steps: dict[str, int] = {}

    def _log(self, name: str, kind: str, value: Any, weight: Any) -> None:
        super()._log(name, kind, value, weight)
        one = Tracker()
        one.log(name, value, weight, kind=kind)
        prefix = name.split("/", 1)[0]
        rows = value.shape[0] if isinstance(value, torch.Tensor) and value.dim() else 1
        self.calls.append(Call(kind, self._opt_steps.get(prefix, 0), rows,
                               one.compute(sync=False)))  # fmt: skip
        if name.endswith("/grad_norm"):  # logged once per optimizer step, after its mbs
            self._opt_steps[prefix] = self._opt_steps.get(prefix, 0) + 1

    def naive(self, by_tokens: bool) -> dict[str, tuple[str, float]]:
        """This rank's verl-style values: {name: (kind, value)}.

        Losses: per optimizer step the sum of each micro-batch's loss times its share
        (1/num micro-batches, or rows/rows with a token budget, as verl's dynamic
        batches), averaged over optimizer steps. max/min: the extreme; last: the last;
        everything else: the mean of per-call values.
        """
        series: dict[str, list[tuple[Call, float]]] = {}
        for call in self.calls:
            for key, value in call.values.items():
                series.setdefault(key, []).append((call, value))
        return {key: (calls[0][0].kind, _reduce_rank(key, calls, by_tokens))
                for key, calls in series.items()}  # fmt: skip


def _reduce_rank(key: str, calls: list[tuple[Call, float]], by_tokens: bool) -> float:
    kind, values = calls[0][0].kind, [v for _, v in calls]
    if key in LOSSES:
        steps: dict[int, list[tuple[Call, float]]] = {}
        for call, value in calls:
            steps.setdefault(call.opt_step, []).append((call, value))
        sums = []
        for mbs in steps.values():
            rows = sum(c.rows for c, _ in mbs)
            sums.append(sum(v * (c.rows / rows if by_tokens else 1 / len(mbs)) for c, v in mbs))
        return sum(sums) / len(sums)
    if kind in ("max", "min"):
        return max(values) if kind == "max" else min(values)
    return values[-1] if kind == "last" else sum(values) / len(values)


def merge_ranks(per_rank: list[dict[str, tuple[str, float]]]) -> dict[str, float]:
    """verl-style over ranks: the extreme for max/min, the mean of the ranks otherwise."""
    out: dict[str, float] = {}
    for key in sorted({k for d in per_rank for k in d}):
        kind = next(d[key][0] for d in per_rank if key in d)
        values = [d[key][1] for d in per_rank if key in d]
        if kind in ("max", "min"):
            out[key] = max(values) if kind == "max" else min(values)
        else:
            out[key] = sum(values) / len(values)
    return out


# -- running the partitions -----------------------------------------------------------
def _run_partition(cfg: TrainConfig, part: Partition, rank: int, group: Any) -> tuple[dict, dict]:
    """Step 1 of ``part`` on this rank: (the exact metrics, this rank's naive values)."""
    from rlmetrics.trainer.train import setup, train_step

    r = setup(part.config(cfg), rank, part.dp, group, None)
    tracker = RecordingTracker()
    exact = train_step(r, 1, tracker)
    return exact, tracker.naive(by_tokens=part.max_tokens is not None)


def _rank_main(rank: int, world: int, port: int, cfg: TrainConfig, parts: list[Partition],
               out: str) -> None:  # fmt: skip
    """One spawned rank: every partition it takes part in, in order; pickles its results."""
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = timedelta(seconds=cfg.run.timeout)
    init = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timeout)
    try:
        sizes = sorted({p.dp for p in parts})
        groups = {d: None if d == world else dist.new_group(list(range(d))) for d in sizes}
        results = {p.label: _run_partition(cfg, p, rank, groups[p.dp])
                   for p in parts if rank < p.dp}  # fmt: skip
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(results))
    exit_now(0)  # skip the interpreter's teardown (see trainer.launch.exit_now)


def run_partitions(cfg: TrainConfig, parts: list[Partition]) -> dict[str, tuple[dict, dict]]:
    """{label: (exact metrics, naive metrics)}; one launch of max(dp) gloo ranks."""
    labels = [p.label for p in parts]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--partitions: duplicate partitions {labels}")
    world = max(p.dp for p in parts)
    if world == 1:
        per_rank = [{p.label: _run_partition(cfg, p, 0, None) for p in parts}]
    else:
        import torch.multiprocessing as mp

        from rlmetrics.trainer.launch import free_port

        with tempfile.TemporaryDirectory(prefix="rlmetrics-audit-") as tmp:
            mp.spawn(_rank_main, args=(world, free_port(), cfg, parts, tmp), nprocs=world)
            per_rank = [pickle.loads(Path(tmp, f"rank{r}.pkl").read_bytes()) for r in range(world)]
    return {p.label: (per_rank[0][p.label][0],
                      merge_ranks([per_rank[r][p.label][1] for r in range(p.dp)]))
            for p in parts}  # fmt: skip


# -- spreads --------------------------------------------------------------------------
@dataclass(frozen=True)
class Spread:
    """How far a metric's partitions lie from the first one."""

    value: float  # the first partition's
    abs_diff: float  # max over partitions of |value - first|
    rel_diff: float  # abs_diff / |first| (0 when equal, inf when first is 0)
    worst: str  # the partition furthest away
    ok: bool  # abs_diff <= tol · max(1, |first|)


@dataclass(frozen=True)
class AuditReport:
    """Per metric, the exact spread (and the naive one when asked), plus what was left out."""

    partitions: list[str]
    tol: float
    exact: dict[str, Spread]
    naive: dict[str, Spread] | None
    excluded: list[str]

    def order(self) -> list[str]:
        """Metric names by drift: exact drifts first, then naive spread, then exact spread."""
        naive = self.naive or {}

        def key(name: str) -> tuple:
            e, n = self.exact[name], naive.get(name)
            return (e.ok, -(n.rel_diff if n else 0.0), -e.rel_diff, name)

        return sorted(self.exact, key=key)

    @property
    def drifting(self) -> list[str]:
        """Metrics whose exact values differ by more than ``tol``."""
        return [name for name in self.order() if not self.exact[name].ok]


def spread(values: dict[str, float | None], tol: float) -> Spread:
    """The spread of one metric over partitions ({label: value, None when missing})."""
    labels = list(values)
    first = values[labels[0]]
    worst, abs_diff = labels[0], 0.0
    for label in labels[1:]:
        v = values[label]
        if first is None or v is None or math.isnan(first) != math.isnan(v):
            diff = math.inf
        else:
            diff = 0.0 if math.isnan(v) else abs(v - first)
        if diff > abs_diff:
            worst, abs_diff = label, diff
    ref = math.nan if first is None else first
    rel = 0.0 if abs_diff == 0 else abs_diff / abs(ref) if ref else math.inf
    ok = abs_diff <= tol * max(1.0, abs(ref)) if first is not None else False
    return Spread(ref, abs_diff, rel, worst, ok)


def build_report(runs: dict[str, tuple[dict, dict]], tol: float, *, naive: bool = False,
                 include_measurements: bool = False) -> AuditReport:  # fmt: skip
    """The spreads of ``run_partitions``'s result."""
    names = sorted({k for exact, _ in runs.values() for k in exact})
    excluded = [] if include_measurements else [n for n in names if n.startswith(MEASUREMENTS)]
    kept = [n for n in names if n not in excluded]
    exact = {n: spread({p: e.get(n) for p, (e, _) in runs.items()}, tol) for n in kept}
    naive_spreads = None
    if naive:
        naive_spreads = {n: spread({p: v.get(n) for p, (_, v) in runs.items()}, tol)
                         for n in kept}  # fmt: skip
    return AuditReport(list(runs), tol, exact, naive_spreads, excluded)


# -- output ---------------------------------------------------------------------------
def verdict(report: AuditReport) -> str:
    """``N metrics invariant to TOL; M drift`` (+ the naive count, the exclusions)."""
    drift = len(report.drifting)
    line = (
        f"{len(report.exact) - drift} metrics invariant to {report.tol:g}; {drift} drift "
        f"(across {len(report.partitions)} partitions: {', '.join(report.partitions)})"
    )
    if report.naive is not None:
        naive_drift = sum(not s.ok for s in report.naive.values())
        line += f"; naive (verl-style) aggregation: {naive_drift} drift"
    if report.excluded:
        names = ", ".join(report.excluded)
        line += f"\nexcluded (measurements, not functions of the batch): {names}"
    return line


def _num(x: float) -> str:
    return f"{x:.3g}" if x else "0"


def render(report: AuditReport, console: Any = None) -> None:
    """Print the table (rich), sorted by drift, and the verdict line."""
    from rich.console import Console
    from rich.table import Table

    if console is None:  # piped output: wide enough for every column
        console = Console(width=None if Console().is_terminal else 150)
    table = Table(title=f"metric spread across partitions (vs {report.partitions[0]})")
    for col in ("metric", "value", "max |Δ|", "rel Δ", ""):
        table.add_column(col, justify="left" if col == "metric" else "right", no_wrap=True)
    if report.naive is not None:
        for col in ("naive value", "naive |Δ|", "naive rel Δ", "worst (naive)"):
            table.add_column(col, justify="right")
    for name in report.order():
        e = report.exact[name]
        row = [name, f"{e.value:.6g}", _num(e.abs_diff), _num(e.rel_diff),
               "ok" if e.ok else f"[red]DRIFT ({e.worst})[/]"]  # fmt: skip
        if report.naive is not None:
            n = report.naive[name]
            style = "" if n.ok else "[yellow]"
            row += [f"{n.value:.6g}", f"{style}{_num(n.abs_diff)}", f"{style}{_num(n.rel_diff)}",
                    "" if n.ok else n.worst]  # fmt: skip
        table.add_row(*row)
    console.print(table)
    console.print(verdict(report), soft_wrap=True, highlight=False)


def plot(report: AuditReport, path: str | Path) -> Path:
    """A horizontal bar per metric: log10 of its relative spread (exact and naive)."""
    from matplotlib.figure import Figure

    names = report.order()[::-1]  # the most drifting at the top
    series = [("exact", report.exact, "tab:blue")]
    if report.naive is not None:
        series.append(("naive (verl-style)", report.naive, "tab:orange"))
    height = 0.8 / len(series)
    fig = Figure(figsize=(9, 1.6 + 0.26 * len(names) * len(series) ** 0.5), layout="constrained")
    ax = fig.subplots()
    floor = math.log10(FLOOR)
    for i, (label, spreads, color) in enumerate(series):
        logs = [min(math.log10(max(spreads[n].rel_diff, FLOOR)), 3.0) for n in names]
        ys = [y + (i - (len(series) - 1) / 2) * height for y in range(len(names))]
        ax.barh(ys, [v - floor for v in logs], left=floor, height=height, color=color, label=label)
    ax.axvline(math.log10(report.tol), color="tab:red", linestyle="--",
               label=f"tolerance {report.tol:g}")  # fmt: skip
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xlim(floor, 3.0)
    ax.set_xlabel(f"log10 relative spread across partitions (0 drawn at {floor:.0f}; inf at 3)")
    ax.set_title(f"rlmetrics audit: {', '.join(report.partitions)}", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.savefig(path, dpi=120)
    return Path(path)


# -- command line ---------------------------------------------------------------------
def add_audit_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``rlmetrics audit`` flags."""
    add = parser.add_argument
    add("--partitions", default=DEFAULT_PARTITIONS, metavar="LIST",
        help="comma-separated DP[:mbs=M|:tokens=T|:whole]; the first is the reference "
             f"(default: {DEFAULT_PARTITIONS})")  # fmt: skip
    add("--algo", choices=("grpo", "ppo"), default="grpo", help="algorithm (default: grpo)")
    add("--num-prompts", type=int, default=7, metavar="P", help="prompts (default: 7)")
    add("--samples-per-prompt", type=int, default=3, metavar="N", help="samples (default: 3)")
    add("--mini-batches", type=int, default=2, metavar="K", help="optimizer steps (default: 2)")
    add("--epochs", type=int, default=2, metavar="E", help="PPO epochs (default: 2)")
    add("--seed", type=int, default=0, metavar="S", help="seed (default: 0)")
    add("--tol", type=float, default=1e-9, metavar="X",
        help="a metric drifts when |Δ| > tol·max(1, |value|) (default: 1e-9)")  # fmt: skip
    add("--naive", action="store_true",
        help="also show what a verl-style reduction would have logged")  # fmt: skip
    add("--plot", metavar="PNG", help="draw the spreads into this image")
    add(
        "--include-measurements",
        action="store_true",
        help="also compare timing_s/*, timing_per_token_ms/*, perf/* (excluded by default)",
    )


def run_audit(args: argparse.Namespace) -> int:
    """``rlmetrics audit``: 0 when every metric is invariant, 1 when one drifts."""
    try:
        parts = parse_partitions(args.partitions)
        cfg = audit_config(
            args.algo,
            num_prompts=args.num_prompts,
            samples_per_prompt=args.samples_per_prompt,
            mini_batches=args.mini_batches,
            epochs=args.epochs,
            seed=args.seed,
        )
    except ValueError as err:
        raise SystemExit(f"rlmetrics audit: error: {err}") from err
    print(describe(cfg, parts))
    report = build_report(run_partitions(cfg, parts), args.tol, naive=args.naive,
                          include_measurements=args.include_measurements)  # fmt: skip
    render(report)
    if args.plot:
        print(f"plot: {plot(report, args.plot)}")
    return 1 if report.drifting else 0


def describe(cfg: TrainConfig, parts: list[Partition]) -> str:
    """What is audited: the run and, per partition, the rows each rank holds."""
    from rlmetrics.trainer.rollout import shard_indices

    algo = cfg.algo
    lines = [f"auditing step 1 of {algo.algo} (float64): {algo.num_prompts} prompts x "
             f"{algo.samples_per_prompt} samples, {algo.mini_batches} mini-batches, "
             f"{algo.epochs} epochs"]  # fmt: skip
    for p in parts:
        rows = [sum(len(x) for x in shard_indices(algo.num_seqs, algo.mini_batches, r, p.dp))
                for r in range(p.dp)]  # fmt: skip
        how = (f"micro-batches of {p.micro_batch_size}" if p.micro_batch_size else
               f"micro-batches of <= {p.max_tokens} tokens" if p.max_tokens else
               "one micro-batch per mini-batch")  # fmt: skip
        lines.append(f"  {p.label}: {p.dp} rank(s), rows per rank {rows}, {how}")
    return "\n".join(lines)
