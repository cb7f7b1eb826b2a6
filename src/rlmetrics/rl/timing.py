"""Stage timers and throughput."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor

from rlmetrics.rl.updates import MetricUpdate
from rlmetrics.tracker import LogMethods


@dataclass
class Stage:
    """What ``timer`` yields: set ``num_tokens`` inside the block when it is known only
    there (e.g. the response tokens of a generation stage)."""

    num_tokens: float | None = None


@contextmanager
def timer(
    tracker: LogMethods,
    stage: str,
    *,
    num_tokens: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[Stage]:
    """Time a stage; log ``timing_s/<stage>`` (kind ``max``) on exit.

    ``max`` because ranks run a stage in parallel: the step waits for the slowest rank,
    and a stage entered several times in a step reports its longest run (wrap a loop,
    not its body). With ``num_tokens`` (the step's tokens, all ranks; or set on the
    yielded ``Stage`` inside the block) it also logs ``timing_per_token_ms/<stage>`` =
    1000 · seconds / num_tokens. Timing asynchronous device work needs a device
    synchronise at the end of the block.

    Example:
        >>> from rlmetrics import Tracker
        >>> t = Tracker()
        >>> with timer(t, "gen", clock=iter([1.0, 3.5]).__next__):
        ...     pass
        >>> t.compute()
        {'timing_s/gen': 2.5}
    """
    info = Stage(num_tokens)
    start = clock()
    try:
        yield info
    finally:
        seconds = clock() - start
        tracker.max(f"timing_s/{stage}", seconds)
        if info.num_tokens is not None:
            per_token = 1000.0 * seconds / max(float(info.num_tokens), 1.0)
            tracker.max(f"timing_per_token_ms/{stage}", per_token)


def perf_updates(num_tokens: float | Tensor, step_seconds: float) -> list[MetricUpdate]:
    """perf/total_num_tokens (sum over ranks) and perf/throughput (tokens per second per
    rank: the mean over ranks of this rank's tokens / step_seconds).

    Log once per step on every rank with this rank's tokens (prompt + response).
    """
    if not step_seconds > 0:
        raise ValueError(f"step_seconds must be > 0, got {step_seconds!r}")
    if isinstance(num_tokens, Tensor):
        num_tokens = num_tokens.detach().double()
    return [
        MetricUpdate("perf/total_num_tokens", "sum", num_tokens),
        MetricUpdate("perf/throughput", "mean", num_tokens / step_seconds),
    ]
