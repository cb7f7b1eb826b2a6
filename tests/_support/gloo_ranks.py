"""Run a function on N real gloo ranks (spawned processes on 127.0.0.1).

Spawning ranks (each a fresh interpreter importing torch) costs far more than most
checks run on them, so ``run_together`` runs several functions one after another on
one spawned group, and each test reads its own function's outcome.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from rlmetrics.distributed import free_port


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
    start_method: str = "spawn",
) -> dict[int, tuple[str, Any]]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Returns {rank: ("ok", result) | ("error", text)}. Raises AssertionError when a rank
    not listed in ``allow_missing`` reports nothing within ``timeout`` seconds.
    ``start_method="fork"`` starts the ranks in milliseconds instead of seconds, so a test
    in the fast suite can use it; only for a ``fn`` that needs no CUDA and no thread of the
    parent (a forked child has neither).
    """
    ctx = mp.get_context(start_method)
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


Call = tuple[Callable[..., Any], tuple]


def _run_each(rank: int, world_size: int, calls: dict[str, Call]) -> dict[str, tuple[str, Any]]:
    """Run ``fn(rank, world_size, *args)`` for each call in order; an outcome per call.

    After a call fails on this rank the rest are not run: its peers may be waiting in a
    collective of the failed call, so later ones would pair the wrong messages.
    """
    out: dict[str, tuple[str, Any]] = {}
    failed = ""
    for name, (fn, args) in calls.items():
        if failed:
            out[name] = ("error", f"not run: {failed!r} failed on this rank first")
            continue
        try:
            out[name] = ("ok", fn(rank, world_size, *args))
        except Exception as error:
            out[name] = ("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
            failed = name
    return out


def run_together(
    calls: dict[str, Call], world_size: int, **options: Any
) -> dict[str, dict[int, tuple[str, Any]]]:
    """Run several calls on one spawned group of ``world_size`` gloo ranks, in order.

    Returns {call name: {rank: ("ok", result) | ("error", text)}}, each value what
    ``run_ranks`` would return for that call alone (pass it to ``ok_results``). A call
    that changes module globals must restore them (``pytest.MonkeyPatch.context()``);
    one that counts collectives or depends on what the group has cached creates its own
    group with ``dist.new_group``. ``options`` go to ``run_ranks``.
    """
    outcome = run_ranks(_run_each, world_size, calls, **options)
    per_call: dict[str, dict[int, tuple[str, Any]]] = {name: {} for name in calls}
    for rank, (status, value) in outcome.items():
        for name in calls:
            per_call[name][rank] = value[name] if status == "ok" else (status, value)
    return per_call


COUNTED = ("all_gather", "all_reduce", "all_gather_into_tensor", "broadcast")


def count_collectives(patch: Any = None) -> dict[str, int]:
    """Count this rank's collectives (``COUNTED`` of torch.distributed) from now on:
    until ``patch`` (a ``pytest.MonkeyPatch``) is undone, or for the rest of the process
    without one. Returns the live count, ``{"n": calls}``."""
    counts = {"n": 0}
    for name in COUNTED:
        original = getattr(dist, name)

        def wrapped(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            counts["n"] += 1
            return _original(*args, **kwargs)

        if patch is None:
            setattr(dist, name, wrapped)
        else:
            patch.setattr(dist, name, wrapped)
    return counts
