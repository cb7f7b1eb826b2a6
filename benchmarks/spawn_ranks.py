"""Run a benchmark's worker on a local gloo group of spawned ranks."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from rlmetrics.distributed import free_port


def spawn_ranks(worker: Callable[..., None], world: int, args: tuple, timeout: float) -> Any:
    """Spawn ``world`` processes running ``worker(rank, world, port, *args, queue)`` and
    return the first object one puts on ``queue``; a string there is an error report,
    raised. The processes are joined (killed after 30 s) whatever happens."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        out = queue.get(timeout=timeout)
        if isinstance(out, str):
            raise RuntimeError(out)
        return out
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def serve_rank(rank: int, world: int, port: int, queue: Any, work: Callable[[], Any]) -> None:
    """One spawned rank: join the gloo group on 127.0.0.1:``port``, run ``work``, put
    rank 0's result on ``queue`` (any rank's error as text, for ``spawn_ranks`` to
    raise), and leave the group whatever happens."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        result = work()
        if rank == 0:
            queue.put(result)
    except BaseException as error:
        queue.put(f"rank {rank}: {type(error).__name__}: {error}\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()
