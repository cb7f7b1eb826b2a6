"""Helpers for code that runs beside a tracker's sync: ranks and sizes of groups,
summed counts (``rl.global_counts``), replica sources, and a free port for a local
group's rendezvous. Each collective here waits with a timeout, as the sync's do."""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import Tensor

from rlmetrics._engine.sync import all_reduce, as_timeout, is_initialized, resolve_group


def rank_in(group: Any) -> int:
    """This process's rank in ``group`` (-1 when it is not a member)."""
    return dist.get_rank(group)


def world_size(group: Any = None) -> int:
    """The size of ``group`` (default: the world); 1 when torch.distributed is not
    initialised, so single-process code takes the same path."""
    return dist.get_world_size(resolve_group(group)) if is_initialized() else 1


def all_reduce_max(tensor: Tensor, group: Any, timeout: float | timedelta | None = None) -> Tensor:
    """Max ``tensor`` in place over ``group`` (raises SyncTimeoutError rather than hang)."""
    all_reduce(tensor, dist.ReduceOp.MAX, group, as_timeout(timeout), "all_reduce(MAX)")
    return tensor


def all_reduce_sum(
    tensor: Tensor, group: Any = None, timeout: float | timedelta | None = None
) -> Tensor:
    """Sum ``tensor`` in place over ``group`` (a no-op on one process); returns it."""
    if world_size(group) > 1:
        all_reduce(
            tensor, dist.ReduceOp.SUM, resolve_group(group), as_timeout(timeout), "all_reduce(SUM)"
        )
    return tensor


def is_replica_source(mesh: Any, replica_dims: tuple[str, ...]) -> bool:
    """True on the one copy (local rank 0 in every ``replica_dims``) that should log
    when metrics are merged over a group containing tensor/pipeline-parallel replicas."""
    return all(mesh.get_local_rank(dim) == 0 for dim in replica_dims)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for a local process group's
    rendezvous: spawned gloo ranks in the launcher, tests and benchmarks)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


__all__ = [
    "all_reduce_max",
    "all_reduce_sum",
    "free_port",
    "is_replica_source",
    "rank_in",
    "world_size",
]
