"""Spawn gloo ranks for verl's worker code, in a temporary HOME (see conftest.py)."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=600),
        )
        queue.put((rank, None, fn(rank, world, port, *args)))
    except BaseException as error:
        queue.put((rank, f"{type(error).__name__}: {error}\n{traceback.format_exc()}", None))


def spawn_ranks(fn: Callable, world: int, *args: Any, timeout: float = 900.0) -> list[Any]:
    """``fn(rank, world, port, *args)`` on ``world`` spawned gloo ranks; the results in
    rank order. Raises AssertionError with a rank's traceback if one failed."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, fn, args, queue)) for r in range(world)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, error, value = queue.get(timeout=timeout)
            assert error is None, f"rank {rank} failed:\n{error}"
            results[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [results[r] for r in range(world)]
