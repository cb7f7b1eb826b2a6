"""Helpers for code that runs beside a tracker's sync.

They give ranks and sizes of groups, summed counts (``rl.global_counts``), each rank's
bytes, replica sources, and a free port for a local group's rendezvous. Each collective
here waits with a timeout, as the sync's do. This module and the engine's sync stage are
the only ones that import ``torch.distributed``.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import Tensor

from rlmetrics._engine import sync
from rlmetrics._engine.sync import all_reduce, as_timeout, comm_device, resolve_group


def is_initialized() -> bool:
    """Whether torch.distributed is available and initialised in this process."""
    return sync.is_initialized()


def process_group(group: Any = None) -> Any:
    """The ProcessGroup of ``group``: None (the default group), a group, a 1-D
    DeviceMesh or a (DeviceMesh, dim name) pair, as ``Tracker.compute(group=...)`` takes.

    Raises:
        RuntimeError: ``group`` is None and torch.distributed is not initialised.
        ValueError: this process is not in ``group``.
    """
    return resolve_group(group)


def gather_bytes(
    payload: bytes, group: Any = None, timeout: float | timedelta | None = None
) -> list[bytes]:
    """Every rank's ``payload``, in rank order (two all_gathers: lengths, then bytes)."""
    pg = resolve_group(group)
    return sync.gather_bytes(payload, pg, comm_device(pg), as_timeout(timeout))


def rank_in(group: Any) -> int:
    """This process's rank in ``group`` (-1 when it is not a member)."""
    return dist.get_rank(group)


def world_size(group: Any = None) -> int:
    """The size of ``group`` (default: the world); 1 when torch.distributed is not
    initialised, so single-process code takes the same path."""
    return dist.get_world_size(resolve_group(group)) if sync.is_initialized() else 1


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
    "gather_bytes",
    "is_initialized",
    "is_replica_source",
    "process_group",
    "rank_in",
    "world_size",
]
