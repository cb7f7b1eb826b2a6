"""The contenders of ``sync_bench.py``: one step's metric sync, each its own way.

Each contender logs a step's values untimed (``prepare``), then syncs and computes
(``run``, the part ``sync_bench.py`` times); ``finish`` clears it, untimed. See
``sync_bench.py`` for what each one does and how they are compared.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rlmetrics import Tracker
from rlmetrics._engine import sync as rd

KINDS = ("mean", "sum", "max", "min", "last")
MICRO_BATCHES = 4

Values = list[list[float]]  # [metric][micro-batch]


class Contender:
    """One sync implementation: ``prepare`` (untimed logging), ``run`` (timed)."""

    name = ""

    def prepare(self, values: Values) -> None:
        raise NotImplementedError

    def run(self) -> Any:
        raise NotImplementedError

    def finish(self) -> None:
        """Untimed clean-up after ``run``."""


class RlMetrics(Contender):
    name = "rlmetrics"

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.tracker = Tracker()

    def prepare(self, values: Values) -> None:
        t = self.tracker
        methods = [getattr(t, KINDS[i % len(KINDS)]) for i in range(len(self.names))]
        for mb in range(MICRO_BATCHES):
            for log, name, vals in zip(methods, self.names, values, strict=True):
                log(name, vals[mb])

    def run(self) -> dict[str, float]:
        return self.tracker.compute()

    def issued(self, values: Values, limit: int | None = None) -> list[tuple[str, int, Any]]:
        """Log ``values`` and run compute() once, recording (collective, numel, op) of
        every all_reduce and all_gather it issues; ``limit`` replaces
        rd.GATHER_LIMIT for this call (0: the all_reduce pair at any size)."""
        seen: list[tuple[str, int, Any]] = []
        reduce, gather, default = dist.all_reduce, dist.all_gather, rd.GATHER_LIMIT

        def spy_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, **kwargs: Any) -> Any:
            seen.append(("all_reduce", tensor.numel(), op))
            return reduce(tensor, op=op, **kwargs)

        def spy_gather(out: list[torch.Tensor], tensor: torch.Tensor, **kwargs: Any) -> Any:
            seen.append(("all_gather", tensor.numel(), None))
            return gather(out, tensor, **kwargs)

        dist.all_reduce, dist.all_gather = spy_reduce, spy_gather
        rd.GATHER_LIMIT = default if limit is None else limit
        try:
            self.prepare(values)
            self.run()
        finally:
            dist.all_reduce, dist.all_gather, rd.GATHER_LIMIT = reduce, gather, default
        return seen


class Local(RlMetrics):
    """A second tracker logged the same values, computed without the process group:
    the local half of ``compute()`` (fold, results) with no collective."""

    name = "local"

    def run(self) -> dict[str, float]:
        return self.tracker.compute(sync=False)


class Bare(Contender):
    """The SUM and MAX buffers alone: one all_gather and a host reduction (``gather``),
    or all_reduce(SUM) + all_reduce(MAX)."""

    def __init__(self, name: str, num_sums: int, num_maxes: int, gather: bool) -> None:
        self.name = name
        self.num_sums = num_sums
        self.gather = gather
        self.sums = torch.zeros(num_sums, dtype=torch.float64)
        self.maxes = torch.zeros(num_maxes, dtype=torch.float64)

    def prepare(self, values: Values) -> None:
        flat = np.resize(np.asarray(values).ravel(), len(self.sums) + len(self.maxes))
        self.sums.copy_(torch.from_numpy(flat[: len(self.sums)]))
        self.maxes.copy_(torch.from_numpy(flat[len(self.sums) :]))

    def run(self) -> tuple[list[float], list[float]]:
        if not self.gather:
            dist.all_reduce(self.sums, op=dist.ReduceOp.SUM)
            dist.all_reduce(self.maxes, op=dist.ReduceOp.MAX)
            return self.sums.numpy().tolist(), self.maxes.numpy().tolist()
        both = torch.cat((self.sums, self.maxes))
        rows = [torch.empty_like(both) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, both)
        gathered = torch.stack(rows).numpy()
        total = gathered[0, : self.num_sums].copy()
        for row in gathered[1:]:  # rank order, as rlmetrics adds
            total += row[: self.num_sums]
        return total.tolist(), gathered[:, self.num_sums :].max(axis=0).tolist()


def bare_contenders(rl: RlMetrics, values: Values) -> tuple[Bare, Bare]:
    """(bare: what rlmetrics' steady-state compute() issues, bare pair: the all_reduces)."""
    pair = rl.issued(values, limit=0)
    if [(name, op) for name, _, op in pair] != [
        ("all_reduce", dist.ReduceOp.SUM),
        ("all_reduce", dist.ReduceOp.MAX),
    ]:
        raise RuntimeError(f"rlmetrics issued {pair}, expected one SUM and one MAX all_reduce")
    num_sums, num_maxes = pair[0][1], pair[1][1]
    steady = rl.issued(values)
    if [name for name, _, _ in steady] == ["all_gather"]:
        # the gather carries no NaN counts: its additive part is shorter than the pair's
        gathered = steady[0][1]
        bare = Bare("bare", gathered - num_maxes, num_maxes, True)
    elif steady == pair:
        bare = Bare("bare", num_sums, num_maxes, False)
    else:
        raise RuntimeError(f"rlmetrics issued {steady}, expected one all_gather or {pair}")
    return bare, Bare("bare pair", num_sums, num_maxes, False)


class LocalThenBare(Contender):
    """``local`` then ``bare``, one after the other in one timed run: what a sync costs
    at least when it does the local work and then the collective (the ranks' local work
    ends at different times, and the collective starts from there)."""

    name = "local then bare"

    def __init__(self, local: Local, bare: Bare) -> None:
        self.local, self.bare = local, bare

    def prepare(self, values: Values) -> None:
        self.local.prepare(values)
        self.bare.prepare(values)

    def run(self) -> Any:
        self.local.run()
        return self.bare.run()

    def finish(self) -> None:
        self.local.finish()
        self.bare.finish()


class VerlStyle(Contender):
    name = "verl"

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.metrics: dict[str, list[float]] = {}

    def prepare(self, values: Values) -> None:
        self.metrics = {name: [] for name in self.names}
        for mb in range(MICRO_BATCHES):
            for name, vals in zip(self.names, values, strict=True):
                self.metrics[name].append(vals[mb])

    def run(self) -> dict[str, float]:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.metrics)
        return {k: float(np.mean([v for d in gathered for v in d[k]])) for k in gathered[0]}


class TorchMetrics(Contender):
    name = "torchmetrics"

    def __init__(self, names: list[str]) -> None:
        from torchmetrics import MeanMetric, MetricCollection

        self.names = names
        self.collection = MetricCollection(
            {name: MeanMetric() for name in names}, compute_groups=False
        )

    def prepare(self, values: Values) -> None:
        metrics = [self.collection[name] for name in self.names]
        for mb in range(MICRO_BATCHES):
            for metric, vals in zip(metrics, values, strict=True):
                metric.update(vals[mb])

    def run(self) -> dict[str, Any]:
        return self.collection.compute()

    def finish(self) -> None:
        self.collection.reset()


class TorchEval(Contender):
    """torcheval: a dict of N ``Mean`` metrics (updated with 0-d float64 tensors, as
    torcheval's update takes tensors), ``sync_and_compute_collection`` (reset untimed)."""

    name = "torcheval"

    def __init__(self, names: list[str]) -> None:
        from torcheval.metrics import Mean
        from torcheval.metrics.toolkit import sync_and_compute_collection

        self.names = names
        self.metrics = {name: Mean() for name in names}
        self.sync = sync_and_compute_collection

    def prepare(self, values: Values) -> None:
        metrics = [self.metrics[name] for name in self.names]
        for mb in range(MICRO_BATCHES):
            for metric, vals in zip(metrics, values, strict=True):
                metric.update(torch.tensor(vals[mb], dtype=torch.float64))

    def run(self) -> dict[str, Any]:
        return self.sync(self.metrics)

    def finish(self) -> None:
        for metric in self.metrics.values():
            metric.reset()
