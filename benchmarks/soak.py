"""Soak: many steps of many metrics through Tracker.compute() on 2 gloo ranks.

    .venv/bin/python benchmarks/soak.py                      # 10,000 steps x 500 metrics
    .venv/bin/python benchmarks/soak.py --steps 300 --metrics 100 --json out.json

Each rank logs every metric every step (scalar kinds mean/sum/max/min/last; python floats,
and every ``--tensor-every``-th metric a small CPU tensor), then calls ``compute()`` over
the 2-rank group. Reported per rank: resident memory (psutil RSS) at step 100 and at the
end (and every 10% in between), schema agreements and cached layouts (must stay 1: the
name set never changes), steps/s, and whether every checked step was exact.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlmetrics import Tracker
from rlmetrics._engine import sync as rd

KINDS = ("mean", "sum", "max", "min", "last")
CHECK_EVERY = 500  # steps whose values are checked exactly


def log_step(tracker: Tracker, rank: int, step: int, num_metrics: int, tensor_every: int) -> None:
    """Metric i logs value (step + i + rank) % 97 (+ 0.5 for odd i); tensors log it twice."""
    for i in range(num_metrics):
        kind = KINDS[i % len(KINDS)]
        value = float((step + i + rank * (kind != "last")) % 97) + 0.5 * (i % 2)
        if i % tensor_every == 0:
            shape = () if kind == "last" else (2,)
            value = torch.full(shape, value, dtype=torch.float64)
        tracker.log(f"soak/{kind}/{i:04d}", value, kind=kind)


def expected(step: int, num_metrics: int, world: int, tensor_every: int) -> dict[str, float]:
    out = {}
    for i in range(num_metrics):
        kind = KINDS[i % len(KINDS)]
        per_rank = [
            float((step + i + r * (kind != "last")) % 97) + 0.5 * (i % 2) for r in range(world)
        ]
        copies = 2 if i % tensor_every == 0 else 1
        out[f"soak/{kind}/{i:04d}"] = {
            "mean": sum(per_rank) / world,
            "sum": sum(per_rank) * copies,
            "max": max(per_rank),
            "min": min(per_rank),
            "last": per_rank[0],
        }[kind]
    return out


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def run_rank(rank: int, world: int, port: int, args: dict[str, Any], queue: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    agreements = {"n": 0}
    original = rd.agree_schema

    def counted(*a: Any, **k: Any) -> Any:
        agreements["n"] += 1
        return original(*a, **k)

    rd.agree_schema = counted
    steps, num_metrics, tensor_every = args["steps"], args["metrics"], args["tensor_every"]
    tracker = Tracker()
    rss: dict[int, float] = {}
    checked = exact = 0
    marks = {100, steps, *range(0, steps + 1, max(steps // 10, 1))} - {0}
    start = time.perf_counter()
    for step in range(1, steps + 1):
        log_step(tracker, rank, step, num_metrics, tensor_every)
        out = tracker.compute(timeout=120)
        if step % CHECK_EVERY == 0 or step in (1, steps):
            checked += 1
            exact += out == expected(step, num_metrics, world, tensor_every)
        if step in marks:
            gc.collect()
            rss[step] = round(rss_mib(), 1)
    elapsed = time.perf_counter() - start
    queue.put(
        {
            "rank": rank,
            "steps": steps,
            "metrics": num_metrics,
            "seconds": round(elapsed, 1),
            "steps_per_s": round(steps / elapsed, 1),
            "rss_mib": rss,
            "rss_step100_mib": rss.get(100),
            "rss_end_mib": rss[steps],
            "agreements": agreements["n"],
            "cached_layouts": len(tracker._plan.group_syncs),
            "checked_steps": checked,
            "exact_steps": exact,
        }
    )
    dist.destroy_process_group()


def soak(steps: int, metrics: int, tensor_every: int = 5, world: int = 2) -> list[dict]:
    """Run the soak on ``world`` gloo ranks; one summary dict per rank."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    args = {"steps": steps, "metrics": metrics, "tensor_every": tensor_every}
    procs = [ctx.Process(target=run_rank, args=(r, world, port, args, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        results = [queue.get(timeout=3600) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return sorted(results, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--metrics", type=int, default=500)
    parser.add_argument("--tensor-every", type=int, default=5)
    parser.add_argument("--json", help="also write the summaries to this file")
    args = parser.parse_args()
    results = soak(args.steps, args.metrics, args.tensor_every)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    ok = all(
        r["agreements"] == 1 and r["cached_layouts"] == 1 and r["exact_steps"] == r["checked_steps"]
        for r in results
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
