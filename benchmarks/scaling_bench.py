"""Check docs/scaling.md's model against real gloo ranks: bytes, collectives, time trends.

Run from the repository root (a few minutes on 2 shared cores):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/scaling_bench.py

Options: ``--worlds 2 4 8 16``, ``--no-write`` (print only). By default the section
between the ``scaling_bench`` markers of ``benchmarks/RESULTS.md`` is replaced.

Each world size spawns that many gloo ranks on 127.0.0.1 (one thread each; 8 and 16
ranks share this machine's cores, so they stand in for larger groups only in what is
counted, not in absolute time). Every case logs fresh values each iteration (untimed),
then each contender, after a barrier, syncs once while the rank records its wall time,
its process CPU time and the bytes it wrote to sockets (``wchar`` of /proc/self/io,
which counts gloo's writes and nothing else here). One untimed round also records every
collective issued (op and bytes per rank). The model (``scaling_model``) predicts the
collectives and the bytes exactly; the time is compared with a fitted α-β-host model in
``scaling_report``.

Cases: N scalar metrics of mixed kinds (rlmetrics' gather path, its all_reduce pair
forced with ``GATHER_LIMIT = 0``, a verl-style ``all_gather_object`` of per-key lists,
torchmetrics' ``MeanMetric``s at N = 8); scalars with std and dist metrics (extras
gather); four bucketed metrics of B additive slots each (histograms, the shape of a
B-bucket quantile sketch) on both paths, to find where the pair overtakes the gather.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import gc
import io
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist
import torch.distributed.distributed_c10d as c10d

import scaling_model as model
import scaling_report as report
from rlmetrics import Tracker
from rlmetrics._engine import sync as rd
from rlmetrics.kinds import register_kind
from rlmetrics.kinds.histogram import Histogram
from spawn_ranks import serve_rank, spawn_ranks

MICRO = 4  # values per metric per step (micro-batches)
DIST_N = 1_000  # elements per dist metric per rank
BUCKETS = (256, 2_048, 16_384, 65_536)
NUM_BUCKETED = 4
ITERS = {2: 20, 4: 20, 8: 10, 16: 6}  # fewer where ranks share cores
WARMUP = 2


def cases(world: int) -> list[dict[str, Any]]:
    """What each world size measures (every rank builds the same list)."""
    out = [{"case": f"N={n}", "n": n, "tm": n == 8} for n in (8, 64, 512)]
    out.append({"case": "N=8 +2 std +2 dist", "n": 8, "std": 2, "dist": 2})
    out += [{"case": f"4 x B={b}", "n": 0, "bucket": b} for b in BUCKETS]
    return out


class RlSync:
    """rlmetrics' compute() on one path ("gather" or "pair")."""

    def __init__(self, spec: dict[str, Any], path: str, group: Any) -> None:
        self.spec, self.path, self.name, self.group = spec, path, path, group
        self.tracker = Tracker()
        self.kinds = model.mix(spec["n"]) + ["std"] * spec.get("std", 0)
        self.kinds += ["dist"] * spec.get("dist", 0)
        bucket = spec.get("bucket")
        self.bucketed = [] if bucket is None else [bucket_kind(bucket)] * NUM_BUCKETED

    def prepare(self, rng: np.random.Generator, rank: int) -> None:
        t = self.tracker
        values = rng.normal(1.0, 0.5, (len(self.kinds), MICRO))
        for i, kind in enumerate(self.kinds):
            name = f"m{i:04d}"
            if kind == "dist":
                t.dist(name, rng.normal(size=DIST_N))
            elif kind == "last":
                t.last(name, float(i))  # replicated: the same on every rank
            else:
                for value in values[i]:
                    getattr(t, kind)(name, float(value))
        for i, kind in enumerate(self.bucketed):
            t.log(f"h{i}", rng.normal(size=64), kind=kind.name)

    def run(self) -> Any:
        limit, rd.GATHER_LIMIT = rd.GATHER_LIMIT, (1 << 62) if self.path == "gather" else 0
        try:
            return self.tracker.compute(group=self.group)
        finally:
            rd.GATHER_LIMIT = limit

    def predicted(self, world: int) -> list[model.Collective]:
        sums = [kind.num_sums for kind in self.bucketed]
        extras = [model.std_extra()] * self.spec.get("std", 0)
        extras += [model.dist_extra(DIST_N)] * self.spec.get("dist", 0)
        return model.rlmetrics_sync(model.buffers(self.kinds, sums), world, self.path, extras)

    def host_work(self, world: int) -> dict[str, int]:
        """Floats this rank reduces on the host (every gathered row, extras included)
        and the metrics whose results it computes."""
        gathered = [c.size for c in self.predicted(world) if c.op == "all_gather"]
        sums = [kind.num_sums for kind in self.bucketed]
        return {
            "host_floats": world * sum(gathered) // model.FLOAT,
            "metrics": len(self.kinds),
            "G": model.buffers(self.kinds, sums).gather,
        }


def bucket_kind(bucket: int) -> Histogram:
    """A histogram with ``bucket`` additive slots (bucket - 1 edges), registered once."""
    kind = Histogram(
        name=f"scaling_b{bucket}", edges=np.linspace(-4.0, 4.0, bucket - 1), report_bins=False
    )
    return register_kind(kind, exist_ok=True)


class VerlSync:
    """verl's ``allgather_dict_into_dict``: one all_gather_object of the rank's
    dict[str, list[float]], then (driver side, here every rank) a mean per key."""

    name = "verl"

    def __init__(self, spec: dict[str, Any]) -> None:
        self.n = spec["n"]
        self.metrics: dict[str, list[float]] = {}

    def prepare(self, rng: np.random.Generator, rank: int) -> None:
        values = rng.normal(1.0, 0.5, (self.n, MICRO)).tolist()
        self.metrics = {f"actor/metric_{i:04d}_name": v for i, v in enumerate(values)}

    def run(self) -> Any:
        every: list[Any] = [None] * tdist.get_world_size()
        tdist.all_gather_object(every, self.metrics)
        merged: dict[str, list[float]] = {}
        for metrics in every:
            for key, values in metrics.items():
                merged.setdefault(key, []).extend(values)
        return {key: float(np.mean(values)) for key, values in merged.items()}

    def payload(self) -> int:
        buffer = io.BytesIO()
        c10d._pickler(buffer).dump(self.metrics)
        return len(buffer.getvalue())

    def predicted(self, world: int) -> list[model.Collective]:
        return model.verl_sync(self.payload())

    def host_work(self, world: int) -> dict[str, int]:
        """Python floats unpickled and averaged (every rank's every value)."""
        return {"py_elements": world * self.n * MICRO, "metrics": self.n}


class TmSync:
    """torchmetrics: a MetricCollection of N MeanMetrics, compute() (reset untimed)."""

    name = "torchmetrics"

    def __init__(self, spec: dict[str, Any]) -> None:
        from torchmetrics import MeanMetric, MetricCollection

        self.n = spec["n"]
        metrics = {f"m{i}": MeanMetric() for i in range(self.n)}
        self.collection = MetricCollection(metrics, compute_groups=False)

    def prepare(self, rng: np.random.Generator, rank: int) -> None:
        self.collection.reset()
        values = rng.normal(1.0, 0.5, (self.n, MICRO))
        for i in range(self.n):
            for value in values[i]:
                self.collection[f"m{i}"].update(float(value))

    def run(self) -> Any:
        return self.collection.compute()

    def predicted(self, world: int) -> list[model.Collective]:
        return model.torchmetrics_sync(self.n)

    def host_work(self, world: int) -> dict[str, int]:
        return {"metrics": self.n}


def contenders(spec: dict[str, Any]) -> list[Any]:
    """The case's contenders. rlmetrics' get a process group of their own: a group pads
    its buffers to the largest of the layouts recently agreed over it, so cases sharing
    one would measure the largest case's buffers."""
    group = tdist.new_group(list(range(tdist.get_world_size())))
    out: list[Any] = [RlSync(spec, "gather", group), RlSync(spec, "pair", group)]
    if "std" not in spec and "bucket" not in spec:
        out.append(VerlSync(spec))
    if spec.get("tm"):
        out.append(TmSync(spec))
    return out


def written() -> int:
    """Bytes this process has written (sockets included) so far."""
    with open("/proc/self/io") as stats:
        return next(int(line.split()[1]) for line in stats if line.startswith("wchar"))


def issued(contender: Any) -> list[tuple[str, int]]:
    """(op, bytes per rank) of every collective one run issues (untimed)."""
    seen: list[tuple[str, int]] = []
    gather, reduce, barrier = tdist.all_gather, tdist.all_reduce, tdist.barrier

    def spy_gather(out: Any, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append(("all_gather", tensor.nbytes))
        return gather(out, tensor, *args, **kwargs)

    def spy_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append(("all_reduce", tensor.nbytes))
        return reduce(tensor, *args, **kwargs)

    def spy_barrier(*args: Any, **kwargs: Any) -> Any:
        seen.append(("barrier", 0))
        return barrier(*args, **kwargs)

    spies = {"all_gather": spy_gather, "all_reduce": spy_reduce, "barrier": spy_barrier}
    originals = {"all_gather": gather, "all_reduce": reduce, "barrier": barrier}
    for module in (tdist, c10d):
        for name, spy in spies.items():
            setattr(module, name, spy)
    try:
        contender.run()
    finally:
        for module in (tdist, c10d):
            for name, original in originals.items():
                setattr(module, name, original)
    return seen


def measure(contender: Any, rng: np.random.Generator, rank: int) -> tuple[int, int, int]:
    """One timed sync: (wall ns, process CPU ns, bytes written)."""
    contender.prepare(rng, rank)
    tdist.barrier()
    gc.disable()
    before = written()
    start, cpu = time.perf_counter_ns(), time.process_time_ns()
    contender.run()
    wall, cpu = time.perf_counter_ns() - start, time.process_time_ns() - cpu
    after = written()
    gc.enable()
    return wall, cpu, after - before


def bench_case(spec: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """This rank's samples of every contender of one case."""
    rng = np.random.default_rng((rank, world, spec["n"], spec.get("bucket", 0)))
    runners = contenders(spec)
    out: dict[str, Any] = {}
    for c in runners:  # the first step agrees the schema; then one counted round
        c.prepare(rng, rank)
        c.run()
        c.prepare(rng, rank)
        out[c.name] = {"issued": issued(c), "samples": []}
        out[c.name]["predicted"] = [(x.op, x.size) for x in c.predicted(world)]
        out[c.name]["host"] = c.host_work(world)
    for it in range(WARMUP + ITERS[world]):
        shift = it % len(runners)
        for c in runners[shift:] + runners[:shift]:
            sample = measure(c, rng, rank)
            if it >= WARMUP:
                out[c.name]["samples"].append(sample)
    return out


def worker(rank: int, world: int, port: int, queue: Any) -> None:
    """One rank: every case; rank 0 sends every rank's samples."""
    torch.set_num_threads(1)

    def every_case() -> list[tuple[str, list[Any]]]:
        results = []
        for spec in cases(world):
            mine = bench_case(spec, rank, world)
            every: list[Any] = [None] * world
            tdist.all_gather_object(every, mine)
            results.append((spec["case"], every))
        return results

    serve_rank(rank, world, port, queue, every_case)


def run_world(world: int, timeout: float) -> list[tuple[str, list[dict]]]:
    """Spawn ``world`` gloo ranks; every case's per-rank results."""
    return spawn_ranks(worker, world, (), timeout)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--save", type=Path, help="also write the raw samples (JSON) here")
    args = parser.parse_args(argv)
    start, load = time.perf_counter(), os.getloadavg()
    results = {world: run_world(world, args.timeout) for world in args.worlds}
    elapsed, load_end = time.perf_counter() - start, os.getloadavg()
    if args.save:
        args.save.write_text(json.dumps({str(k): v for k, v in results.items()}))
    text = report.section(results, elapsed, (load, load_end))
    print(text)
    if not args.no_write:
        report.write(text)


if __name__ == "__main__":
    main()
