"""Run a function on N real gloo ranks (spawned processes on 127.0.0.1)."""

from __future__ import annotations

import contextlib
import os
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    queue: Any,
    pg_timeout: float,
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException as error:  # report everything to the parent
        queue.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    allow_missing: tuple[int, ...] = (),
) -> dict[int, tuple[str, Any]]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Returns {rank: ("ok", result) | ("error", text)}. Raises AssertionError when a rank
    not listed in ``allow_missing`` reports nothing within ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, pg_timeout))
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, tuple[str, Any]] = {}
    expected = world_size - len(allow_missing)
    try:
        while len(results) < expected:
            rank, status, value = queue.get(timeout=timeout)
            results[rank] = (status, value)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return results


def ok_results(outcome: dict[int, tuple[str, Any]]) -> list[Any]:
    """The per-rank results, raising with the first rank's error text if any failed."""
    errors = [f"rank {r}: {v}" for r, (s, v) in sorted(outcome.items()) if s != "ok"]
    assert not errors, "\n".join(errors)
    return [outcome[r][1] for r in sorted(outcome)]
