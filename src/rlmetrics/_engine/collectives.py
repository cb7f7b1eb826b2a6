"""Process groups, timeouts, and collectives that raise instead of hanging.

Every collective is issued with ``async_op=True`` and waited on with the timeout, so a
rank that died or never arrives raises ``SyncTimeoutError`` on the others (with gloo;
with NCCL the host wait is bounded by the process group's own timeout and watchdog, set
through ``init_process_group(timeout=...)``). ``rlmetrics._engine.sync`` builds the
tracker's sync on these.
"""

from __future__ import annotations

import numbers
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rlmetrics.errors import SyncTimeoutError

# Longer waits count as no timeout: gloo adds the wait to a nanosecond clock, which
# overflows (the wait then fails at once) from about 9e9 s.
MAX_TIMEOUT_S = 1e9


def should_sync(group: Any) -> bool:
    """Whether ``compute()`` merges over a process group."""
    return group is not None or is_initialized()


def resolve_group(group: Any) -> Any:
    """A ProcessGroup from None (the default group), a group, or (DeviceMesh, dim)."""
    if group is None:
        if not is_initialized():
            raise RuntimeError("compute(group=None) needs torch.distributed to be initialised")
        return dist.group.WORLD
    if isinstance(group, tuple):
        mesh, dim = group
        return mesh.get_group(mesh_dim=dim)
    get_group = getattr(group, "get_group", None)
    if get_group is not None and hasattr(group, "mesh_dim_names"):  # a 1-D DeviceMesh
        if group.ndim != 1:
            raise ValueError("pass (mesh, dim_name) to sync over one dimension of a DeviceMesh")
        return get_group()
    return _check_group(group)


def _check_group(group: Any) -> Any:
    """``group`` when it is a process group this process belongs to.

    Raises:
        ValueError: this process is not a member (``dist.new_group`` returns
            ``GroupMember.NON_GROUP_MEMBER`` on the ranks it leaves out).
        TypeError: ``group`` is not a process group.
    """
    if isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"group: this process (global rank {dist.get_rank()}) is not a member of the "
            "process group passed (dist.new_group returns GroupMember.NON_GROUP_MEMBER on "
            "the ranks it leaves out); call compute(group=g) only on g's ranks, or "
            "compute(sync=False) for this process's own values"
        )
    raise TypeError(
        "group must be a ProcessGroup, a DeviceMesh or a (DeviceMesh, dim name) pair, got "
        f"{type(group).__name__} {group!r}"
    )


def is_initialized() -> bool:
    """Whether torch.distributed is available and initialised in this process."""
    return dist.is_available() and dist.is_initialized()


def comm_device(group: Any) -> torch.device:
    """The device collectives of ``group`` run on: CUDA for NCCL, else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def as_timeout(timeout: float | timedelta | None) -> timedelta | None:
    """A sync timeout as a timedelta, or None for the process group's own.

    ``math.inf`` (or any wait beyond ``MAX_TIMEOUT_S``) means no bound of rlmetrics':
    the backend's own timeout (``init_process_group(timeout=...)``) still bounds every
    collective, and longer waits overflow inside gloo (it then times out at once).

    Raises:
        TypeError: ``timeout`` is not a number, a timedelta or None.
        ValueError: ``timeout`` is zero, negative or NaN.
    """
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"timeout must be seconds (a number), a timedelta or None, got "
            f"{type(timeout).__name__} {timeout!r}"
        )
    if not seconds > 0:  # NaN too
        raise ValueError(
            f"timeout must be > 0 seconds (None or math.inf: the process group's own "
            f"timeout), got {timeout!r}"
        )
    if seconds > MAX_TIMEOUT_S:
        return None
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)


def wait_for(work: Any, timeout: timedelta | None, what: str) -> None:
    """Wait for an async collective; raise SyncTimeoutError naming it on failure."""
    start = time.monotonic()
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
    except Exception as error:  # gloo raises RuntimeError/DistBackendError on timeout
        # the backend's reason tells a timeout (hang) from a closed connection (death)
        cause = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise SyncTimeoutError(
            f"rlmetrics sync: {what} did not complete"
            + (f" within {timeout.total_seconds():g} s" if timeout is not None else "")
            + f" (failed after {time.monotonic() - start:.1f} s: {cause}); "
            "a rank may have died, hung, or not called compute()"
        ) from error


def all_reduce(tensor: Tensor, op: Any, group: Any, timeout: timedelta | None, what: str) -> None:
    """An in-place all_reduce that raises SyncTimeoutError instead of hanging."""
    wait_for(dist.all_reduce(tensor, op=op, group=group, async_op=True), timeout, what)


def all_gather(tensor: Tensor, group: Any, timeout: timedelta | None, what: str) -> list[Tensor]:
    """All ranks' equal-sized ``tensor``s, in rank order."""
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    wait_for(dist.all_gather(out, tensor, group=group, async_op=True), timeout, what)
    return out


def gather_bytes(
    payload: bytes, group: Any, device: torch.device, timeout: timedelta | None
) -> list[bytes]:
    """All ranks' byte strings (two all_gathers: lengths, then padded bytes)."""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = [int(n) for n in all_gather(length, group, timeout, "schema length gather")]
    buffer = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    pieces = all_gather(buffer, group, timeout, "schema gather")
    return [bytes(p[:n].cpu().numpy().tobytes()) for p, n in zip(pieces, lengths, strict=True)]


__all__ = [
    "MAX_TIMEOUT_S",
    "all_gather",
    "all_reduce",
    "as_timeout",
    "comm_device",
    "gather_bytes",
    "is_initialized",
    "resolve_group",
    "should_sync",
    "wait_for",
]
