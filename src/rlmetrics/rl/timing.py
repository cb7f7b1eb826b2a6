"""Stage timers and throughput in verl's names, on the rank-aware timer (``rlmetrics.timing``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from rlmetrics.rl.updates import MetricUpdate
from rlmetrics.timing import rank_and_size, throughput_record
from rlmetrics.tracker import LogTarget


@dataclass
class Stage:
    """What ``timer`` yields: set ``num_tokens`` inside the block when it is known only
    there (e.g. the response tokens of a generation stage)."""

    num_tokens: float | None = None


@contextmanager
def timer(
    tracker: LogTarget,
    stage: str,
    *,
    num_tokens: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
    **where: Any,
) -> Iterator[Stage]:
    """Time a stage: ``timing_s/<stage>`` with the rank-aware timer (``Tracker.timer``)
    on exit.

    ``timing_s/<stage>`` is the slowest rank's time in the step (a rank's entries
    summed), with ``/mean``, ``/min`` and ``/slowest_rank`` over the ranks; ``where``
    says which rank this is (``rank=``, ``world_size=``, ``group=``; default: the
    process group) and ``device="cuda"`` times device work with CUDA events. With
    ``num_tokens`` (the step's tokens, all ranks; or set on the yielded ``Stage`` inside
    the block) it also logs ``timing_per_token_ms/<stage>`` = 1000 · seconds /
    num_tokens, kind ``max`` (its longest entry on the slowest rank; host clock only).

    Examples:
        >>> from rlmetrics import Tracker
        >>> t = Tracker()
        >>> with timer(t, "gen", clock=iter([1.0, 3.5]).__next__):
        ...     pass
        >>> t.compute()["timing_s/gen"]
        2.5
    """
    info = Stage(num_tokens)
    name = f"timing_s/{stage}"
    if where.get("device") is not None or where.get("events") is not None:
        with tracker.timer(name, **where):
            yield info
        return
    rank, size = rank_and_size(name, where.get("rank"), where.get("world_size"), where.get("group"))
    start = clock()
    try:
        yield info
    finally:
        seconds = clock() - start
        tracker.elapsed(name, seconds, rank=rank, world_size=size)
        if info.num_tokens is not None:
            per_token = 1000.0 * seconds / max(float(info.num_tokens), 1.0)
            tracker.max(f"timing_per_token_ms/{stage}", per_token)


def perf_updates(
    num_tokens: float | Tensor, step_seconds: float, **where: Any
) -> list[MetricUpdate]:
    """perf/total_num_tokens (sum over ranks) and perf/throughput: Σ tokens over ranks /
    (the slowest rank's step seconds × the number of ranks), verl's per-GPU tokens per
    second, with ``perf/throughput/total`` = Σ tokens / the slowest rank's seconds.

    Log once per step on every rank with this rank's tokens (prompt + response) and its
    step time; ``where``: ``rank=``, ``world_size=``, ``group=`` (default: the process
    group; see ``rlmetrics.timing``). Never a mean of per-rank rates: a fast rank's
    rate is not what the step achieved.

    A tensor count is not read here (no host sync): a negative or non-finite one has
    weight NaN in both updates, so the fold rejects both calls and ``compute()`` raises
    naming the two metrics (on every rank of a sync).
    """
    name = "perf/throughput"
    kind, value, weight = throughput_record(name, num_tokens, step_seconds, **where)
    total = MetricUpdate("perf/total_num_tokens", "sum", num_tokens)
    if isinstance(num_tokens, Tensor):  # the count's copy and its weight: 1, or NaN
        total = MetricUpdate(total.name, "sum", value[-1:], weight[-1:])
    return [total, MetricUpdate(name, kind, value, weight)]
