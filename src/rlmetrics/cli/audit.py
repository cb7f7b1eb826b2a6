"""``rlmetrics audit``: one training step under several partitions, the metrics' spread.

Runs step 1 of the reference trainer (float64) once per partition of the batch (data-
parallel size, micro-batches by size or by a token budget), all in one launch of gloo
ranks with subgroups, and reports per metric how far each partition's value lies from
the first one's. ``--naive`` adds what a verl-style reduction of the same step would
have logged: per-micro-batch values, averaged (losses: pre-scaled, then summed), then
averaged over ranks. ``--plot`` draws the spreads.

``--fn MODULE:FUNCTION --batch FILE.pt`` audits your own ``fn(piece, tracker)`` instead:
it runs over the partitions of ``rlmetrics.testing``'s checker (simulated ranks,
micro-batch sizes, token budgets, empty pieces, a shuffled order), each against the
whole batch, and prints the same table.

    rlmetrics audit
    rlmetrics audit --naive --plot audit.png
    rlmetrics audit --algo ppo --partitions "1,2:mbs=2,3:tokens=30" --tol 1e-12
    rlmetrics audit --fn my_losses:log_metrics --batch batch.pt --ranks 1,2,4 --plot fn.png
"""

from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

import torch

from rlmetrics.cli._audit_report import AuditReport, plot, render, spread_report
from rlmetrics.cli._audit_report import Spread as Spread  # re-exported: the report's API
from rlmetrics.cli._audit_report import spread as spread
from rlmetrics.cli._audit_report import verdict as verdict
from rlmetrics.cli._flags import number_flag, number_list_flag
from rlmetrics.tracker import Tracker
from rlmetrics.trainer.config import SEED_MAX, AlgoConfig, ModelConfig, RunConfig, TrainConfig
from rlmetrics.trainer.launch import exit_now

DEFAULT_PARTITIONS = "1,2:mbs=3,2:tokens=24,4:mbs=1"
MEASUREMENTS = ("timing_s/", "timing_per_token_ms/", "perf/", "actor/perf/", "critic/perf/")
LOSSES = ("actor/pg_loss", "actor/kl_loss", "actor/entropy_loss", "critic/vf_loss")


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
        algo = replace(
            cfg.algo,
            micro_batch_size=self.micro_batch_size,
            max_tokens_per_micro_batch=self.max_tokens,
        )
        return replace(cfg, algo=algo, run=replace(cfg.run, dp=self.dp))


def parse_partitions(text: str) -> list[Partition]:
    """``"1,2:mbs=3,2:tokens=24"`` -> partitions (``DP[:mbs=M|:tokens=T|:whole]``)."""
    out = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        dp, _, rest = item.partition(":")
        key, _, value = rest.partition("=")
        try:
            size = int(value) if value else None
            part = Partition(
                int(dp), *{"mbs": (size, None), "tokens": (None, size)}.get(key, (None, None))
            )
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
        algo=AlgoConfig(
            algo=algo,
            num_prompts=num_prompts,
            samples_per_prompt=samples_per_prompt,
            mini_batches=mini_batches,
            epochs=epochs,
            warmup_steps=1,
        ),
        run=RunConfig(steps=1, seed=seed, loggers="", log_every=0, progress=False),
    )


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

    def _log(self, name: str, kind: str, value: Any, weight: Any, by: Any, labels: Any) -> None:
        super()._log(name, kind, value, weight, by, labels)
        if by is not None or labels is not None:
            return  # its labels' parts come back through _log_shared, one call each
        one = Tracker()
        one.log(name, value, weight, kind=kind)
        prefix = name.split("/", 1)[0]
        rows = value.shape[0] if isinstance(value, torch.Tensor) and value.dim() else 1
        self.calls.append(Call(kind, self._opt_steps.get(prefix, 0), rows, one.compute(sync=False)))
        if name.endswith("/grad_norm"):  # logged once per optimizer step, after its mbs
            self._opt_steps[prefix] = self._opt_steps.get(prefix, 0) + 1

    def _log_shared(self, metrics: list[tuple[str, str]], value: Any, weight: Any) -> None:
        for name, kind in metrics:  # one call each, so that each is recorded
            self._log(name, kind, value, weight, None, None)

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
        return {
            key: (calls[0][0].kind, _reduce_rank(key, calls, by_tokens))
            for key, calls in series.items()
        }


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


def _rank_main(
    rank: int, world: int, port: int, cfg: TrainConfig, parts: list[Partition], out: str
) -> None:
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
        results = {
            p.label: _run_partition(cfg, p, rank, groups[p.dp]) for p in parts if rank < p.dp
        }
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
    return {
        p.label: (
            per_rank[0][p.label][0],
            merge_ranks([per_rank[r][p.label][1] for r in range(p.dp)]),
        )
        for p in parts
    }


# -- spreads --------------------------------------------------------------------------
def build_report(
    runs: dict[str, tuple[dict, dict]],
    tol: float,
    *,
    naive: bool = False,
    include_measurements: bool = False,
) -> AuditReport:
    """The spreads of ``run_partitions``'s result."""
    return spread_report(
        {p: exact for p, (exact, _) in runs.items()},
        tol,
        naive={p: v for p, (_, v) in runs.items()} if naive else None,
        exclude=() if include_measurements else MEASUREMENTS,
    )


# -- command line ---------------------------------------------------------------------
def add_audit_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``rlmetrics audit`` flags. A numeric flag out of its range (NaN, inf, a
    negative ``--tol``, ``--epochs 0``) is a usage error naming it, exit 2."""

    count = number_flag(int, 1)
    add = parser.add_argument
    add(
        "--partitions",
        default=DEFAULT_PARTITIONS,
        metavar="LIST",
        help="comma-separated DP[:mbs=M|:tokens=T|:whole]; the first is the reference "
        f"(default: {DEFAULT_PARTITIONS})",
    )
    add("--algo", choices=("grpo", "ppo"), default="grpo", help="algorithm (default: grpo)")
    add("--num-prompts", type=count, default=7, metavar="P", help="prompts (default: 7)")
    add("--samples-per-prompt", type=count, default=3, metavar="N", help="samples (default: 3)")
    add("--mini-batches", type=count, default=2, metavar="K", help="optimizer steps (default: 2)")
    add("--epochs", type=count, default=2, metavar="E", help="PPO epochs (default: 2)")
    add(
        "--seed",
        type=number_flag(int, 0, SEED_MAX),
        default=0,
        metavar="S",
        help="seed, in [0, 2**32 - 1] (default: 0)",
    )
    add(
        "--tol",
        type=number_flag(float, 0, open_low=True),
        default=1e-9,
        metavar="X",
        help="a metric drifts when |Δ| > tol·max(1, |value|); a finite number > 0 (0 "
        "would ask for identical bits, which no partition promises: sums added in "
        "another order differ in their last bits) (default: 1e-9)",
    )
    add(
        "--naive",
        action="store_true",
        help="also show what a verl-style reduction would have logged",
    )
    add("--plot", metavar="PNG", help="draw the spreads into this image")
    add(
        "--include-measurements",
        action="store_true",
        help="also compare timing_s/*, timing_per_token_ms/*, perf/* (excluded by default)",
    )
    user = parser.add_argument_group(
        "your own function (--fn)",
        "audit fn(piece, tracker) over the partitions of rlmetrics.testing's checker\n"
        "instead of the trainer (--seed: the shuffled run's; the other trainer flags\n"
        "and --naive do not apply)",
    )
    user.add_argument(
        "--fn",
        metavar="MODULE:FUNCTION",
        help="the function, importable from the current directory",
    )
    user.add_argument(
        "--batch", metavar="FILE.pt", help="a torch.save'd dict of tensors sharing their first dim"
    )
    user.add_argument(
        "--ranks",
        metavar="LIST",
        type=number_list_flag(int, 1),
        help="simulated data-parallel sizes (default: 1,2,4)",
    )
    user.add_argument(
        "--micro-batch-sizes",
        metavar="LIST",
        type=number_list_flag(int, 1),
        help="rows per micro-batch (default: 1,2,3 and the whole share)",
    )


def usage_error(err: Exception) -> NoReturn:
    """Exit 2 with ``rlmetrics audit: error: ...`` on stderr, as argparse does: a bad
    flag is never read as exit 1, "a metric drifts". A config value out of range
    names its flag."""
    from rlmetrics.trainer.config import ConfigError

    flag = f"argument --{err.field.replace('_', '-')}: " if isinstance(err, ConfigError) else ""
    print(f"rlmetrics audit: error: {flag}{err}", file=sys.stderr)
    raise SystemExit(2) from err


def run_audit(args: argparse.Namespace) -> int:
    """``rlmetrics audit``: 0 when every metric is invariant, 1 when one drifts, 2 on a
    usage error."""
    check_plot_extra(args.plot)
    if args.fn or args.batch or args.ranks or args.micro_batch_sizes:
        return run_fn_audit(args)
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
        usage_error(err)
    print(describe(cfg, parts))
    report = build_report(
        run_partitions(cfg, parts),
        args.tol,
        naive=args.naive,
        include_measurements=args.include_measurements,
    )
    render(report)
    if args.plot:
        print(f"plot: {plot(report, args.plot)}")
    return 1 if report.drifting else 0


def check_plot_extra(plot_path: str | None) -> None:
    """Before any work: ``--plot`` needs matplotlib (exit naming the extra if missing)."""
    if not plot_path:
        return
    from rlmetrics._optional import require

    try:
        require("matplotlib", "plot", "rlmetrics audit --plot")
    except ImportError as err:
        raise SystemExit(f"rlmetrics audit: error: {err}") from err


def describe(cfg: TrainConfig, parts: list[Partition]) -> str:
    """What is audited: the run and, per partition, the rows each rank holds."""
    from rlmetrics.trainer.rollout import shard_indices

    algo = cfg.algo
    lines = [
        f"auditing step 1 of {algo.algo} (float64): {algo.num_prompts} prompts x "
        f"{algo.samples_per_prompt} samples, {algo.mini_batches} mini-batches, "
        f"{algo.epochs} epochs"
    ]
    for p in parts:
        rows = [
            sum(len(x) for x in shard_indices(algo.num_seqs, algo.mini_batches, r, p.dp))
            for r in range(p.dp)
        ]
        how = (
            f"micro-batches of {p.micro_batch_size}"
            if p.micro_batch_size
            else f"micro-batches of <= {p.max_tokens} tokens"
            if p.max_tokens
            else "one micro-batch per mini-batch"
        )
        lines.append(f"  {p.label}: {p.dp} rank(s), rows per rank {rows}, {how}")
    return "\n".join(lines)


# -- a user's function through the checker (--fn) -------------------------------------
def run_fn_audit(args: argparse.Namespace) -> int:
    """``rlmetrics audit --fn MODULE:FUNCTION --batch FILE.pt``: the checker's runs."""
    from rlmetrics.testing import partition_runs

    try:
        if not (args.fn and args.batch):
            raise ValueError("--fn and --batch go together")
        if args.naive or args.include_measurements or args.partitions != DEFAULT_PARTITIONS:
            raise ValueError("--naive, --partitions, --include-measurements: trainer audit only")
        ranks = args.ranks or [1, 2, 4]
        sizes = args.micro_batch_sizes or None
        fn, batch = load_fn(args.fn), load_batch(args.batch)
    except ValueError as err:
        usage_error(err)
    runs = partition_runs(fn, batch, ranks=ranks, micro_batch_sizes=sizes, seed=args.seed)
    rows = next(iter(batch.values())).shape[0]
    keys = ", ".join(
        f"{k} {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in batch.items()
    )
    print(
        f"auditing {args.fn} on {args.batch}: {rows} rows ({keys}); {len(runs)} runs of "
        f"rlmetrics.testing's checker (ranks {ranks}, micro-batch sizes "
        f"{list(sizes) if sizes else 'default'}), each vs the whole batch"
    )
    if any(v.is_floating_point() and v.dtype != torch.float64 for v in batch.values()):
        print(f"note: not float64: expect rounding differences (--tol {args.tol:g})")
    report = spread_report(runs, args.tol)
    render(report)
    if args.plot:
        print(f"plot: {plot(report, args.plot)}")
    return 1 if report.drifting else 0


def load_fn(spec: str) -> Any:
    """``module:function`` (``module:Class.method`` too), the current directory first."""
    import importlib
    import os
    import sys

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--fn: expected MODULE:FUNCTION, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--fn: cannot import {module_name!r} ({err})") from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"--fn: {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"--fn: {spec!r} is not callable")
    return obj


def load_batch(path: str) -> dict[str, torch.Tensor]:
    """``torch.load(path, weights_only=True)``: a dict of tensors sharing their first dim."""
    try:
        batch = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # missing file, not a torch file, unsafe pickle
        raise ValueError(f"--batch: cannot load {path!r} ({err})") from err
    if (
        not isinstance(batch, dict)
        or not batch
        or not all(isinstance(v, torch.Tensor) and v.dim() for v in batch.values())
    ):
        raise ValueError(f"--batch: {path!r} must hold a non-empty dict of tensors (dim >= 1)")
    firsts = {k: v.shape[0] for k, v in batch.items()}
    if len(set(firsts.values())) != 1:
        raise ValueError(f"--batch: tensors must share their first dimension, got {firsts}")
    return batch
