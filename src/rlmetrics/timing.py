"""Rank-aware stage timings and throughput: the slowest rank, the mean, which rank.

``with tracker.timer("timing_s/gen"):`` (or ``tracker.elapsed(name, seconds)`` for a
time measured elsewhere) reports, over the ranks that timed the stage in the step:
``name`` the slowest rank's time (what the step waited for), ``name/mean``, ``name/min``
and ``name/slowest_rank``. A rank's time is the sum of its entries in the step: a stage
entered three times on a rank counts the three, since "time spent in gen" is what makes
a rank the slowest. ``tracker.throughput(name, tokens, seconds)`` reports Σ tokens
divided by the slowest rank's time, per rank (``name``, verl's per-GPU meaning) and in
all (``name/total``).

The state is one additive slot per rank (``rlmetrics.kinds.rank_time``), so the value
is exact under any merge order and rides in the step's one packed collective. The rank
and the group's size R come from ``rank=`` and ``world_size=`` when given (a Ray
worker, a single-controller setup), else from the process group (``group=``, or the
default group when torch.distributed is initialised), else rank 0 of 1. With
``compute(sync=False)`` a rank reports its own time under every key (and its own index
as the slowest rank). Without a process group, trackers merged on a driver must have
been given distinct ``rank=``: states of the same rank add up, as one rank's entries do.

``device="cuda"`` times device work with CUDA events recorded on the device's current
stream at entry and exit: nothing in the timed region waits for the device; the events
are read when the tracker folds its records at step end (``compute()``, ``state()``,
``merge()``), where the host waits anyway. A mid-step fold reads the finished ones only.
A tensor token count of ``throughput`` waits the same way, as a copy, for the fold at
the step's end, which reads it and logs it as a number, or raises ``TokenCountError``
naming the metric and the count when it is negative or not finite.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from rlmetrics._engine.inputs import check_name
from rlmetrics._engine.sync import is_initialized, resolve_group
from rlmetrics.distributed import rank_in
from rlmetrics.distributed import world_size as group_size
from rlmetrics.errors import TokenCountError
from rlmetrics.kinds.batch import to_device

Clock = Callable[[], float]
EventFactory = Callable[[], Any]
"""Makes an event with ``record()``, ``query()``, ``synchronize()`` and
``elapsed_time(end)`` in milliseconds, as ``torch.cuda.Event(enable_timing=True)``."""


class Timed(Protocol):
    """What timing needs of a Tracker or a prefixed view: its log call by kind name and
    its tracker's ``DeviceTimers``."""

    @property
    def device_timers(self) -> DeviceTimers: ...

    def log(self, name: str, value: Any, weight: Any = None, *, kind: str) -> None: ...


def rank_and_size(name: str, rank: Any, world_size: Any, group: Any) -> tuple[int, int]:
    """This process's rank and the group's size for the metric ``name`` (see the module
    docstring for where they come from).

    Raises:
        TypeError, ValueError: naming the metric and the argument.
    """
    if (rank is None) != (world_size is None):
        raise TypeError(
            f"metric {name!r}: pass rank= and world_size= together (or neither), "
            f"got rank={rank!r}, world_size={world_size!r}"
        )
    if rank is None:
        if group is None and not is_initialized():
            return 0, 1
        pg = resolve_group(group)
        rank, world_size = rank_in(pg), group_size(pg)
    for arg, number in (("rank", rank), ("world_size", world_size)):
        if isinstance(number, bool) or not isinstance(number, numbers.Integral):
            raise TypeError(f"metric {name!r}: {arg} must be an int, got {number!r}")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"metric {name!r}: rank must be in [0, world_size={world_size}), got {rank!r}"
        )
    return int(rank), int(world_size)


def check_seconds(
    name: str, seconds: Any, *, positive: bool = False, what: str = "seconds"
) -> float:
    """An elapsed time (or, ``what="num_tokens"``, a token count) as a python float:
    finite and >= 0 (> 0 with ``positive``)."""
    if isinstance(seconds, bool | Tensor) or not isinstance(seconds, numbers.Real):
        raise TypeError(
            f"metric {name!r}: {what} must be a python or numpy number, got "
            f"{type(seconds).__name__}"
        )
    try:
        value = float(seconds)
    except OverflowError as error:  # a python int beyond float64's range, as a log call
        raise ValueError(f"metric {name!r}: {what} is out of float64's range ({error})") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"metric {name!r}: {what} must be finite and {bound}, got {seconds!r}")
    return value


def _one_hot(size: int, rank: int, value: float) -> tuple[np.ndarray, np.ndarray]:
    values, weights = np.zeros(size), np.zeros(size)
    values[rank], weights[rank] = value, 1.0
    return values, weights


def elapsed_record(
    name: str, seconds: Any, *, rank: Any = None, world_size: Any = None, group: Any = None
) -> tuple[str, np.ndarray, np.ndarray]:
    """The (kind, value, weight) a rank logs for ``seconds`` spent in a stage."""
    seconds = check_seconds(name, seconds)
    rank, size = rank_and_size(name, rank, world_size, group)
    return (f"rank_time@{size}", *_one_hot(size, rank, seconds))


def throughput_record(
    name: str,
    num_tokens: float | Tensor,
    seconds: Any,
    *,
    rank: Any = None,
    world_size: Any = None,
    group: Any = None,
) -> tuple[str, Any, Any]:
    """The (kind, value, weight) a rank logs for ``num_tokens`` processed in
    ``seconds``. A tensor count stays on its device (no host sync): its weight is 1
    where the count is finite and >= 0, else NaN, which the fold rejects (the call is
    dropped and reported at the step's end, on every rank of a sync)."""
    seconds = check_seconds(name, seconds, positive=True)
    rank, size = rank_and_size(name, rank, world_size, group)
    values, weights = _one_hot(size + 1, rank, seconds)
    weights[size] = 1.0
    if not isinstance(num_tokens, Tensor):
        values[size] = check_seconds(name, num_tokens, what="num_tokens")
        return f"rank_throughput@{size}", values, weights
    tokens = check_count_tensor(name, num_tokens).reshape(1)
    device = tokens.device
    valid = (tokens >= 0) & tokens.isfinite()
    value = torch.cat((to_device(values[:size], device), tokens))
    weight = torch.cat(
        (to_device(weights[:size], device), tokens.new_ones(1).where(valid, math.nan))
    )
    return f"rank_throughput@{size}", value, weight


def check_count_tensor(name: str, num_tokens: Tensor) -> Tensor:
    """A tensor token count as a float64 copy of its one number, on its device (a copy:
    a later in-place change of the caller's tensor leaves the logged count as it was).
    A bool or complex tensor is refused, as a python bool or complex is."""
    if num_tokens.dtype == torch.bool or num_tokens.is_complex():
        raise TypeError(
            f"metric {name!r}: num_tokens must be a real number, got a tensor "
            f"of dtype {num_tokens.dtype}"
        )
    if num_tokens.numel() != 1:
        raise ValueError(
            f"metric {name!r}: num_tokens must hold one number, got a tensor "
            f"of shape {tuple(num_tokens.shape)}"
        )
    return num_tokens.detach().reshape(()).to(torch.float64, copy=True)


def log_elapsed(tracker: Timed, name: str, seconds: Any, **where: Any) -> None:
    """Log ``seconds`` this rank spent in the stage ``name`` (``where``: rank=,
    world_size=, group=)."""
    kind, value, weight = elapsed_record(name, seconds, **where)
    tracker.log(name, value, weight, kind=kind)


def log_throughput(
    tracker: Timed, name: str, num_tokens: float | Tensor, seconds: Any, **where: Any
) -> None:
    """Log ``num_tokens`` this rank processed in ``seconds``. A tensor count is read at
    the step's end (``DeviceTimers.read``, from the tracker's fold), where the host
    waits anyway: logged then as a number, or, negative or not finite, raised."""
    if not isinstance(num_tokens, Tensor):
        kind, value, weight = throughput_record(name, num_tokens, seconds, **where)
        tracker.log(name, value, weight, kind=kind)
        return
    seconds = check_seconds(name, seconds, positive=True)
    tokens = check_count_tensor(name, num_tokens)
    rank, size = rank_and_size(name, where.get("rank"), where.get("world_size"), where.get("group"))
    check_name(name)
    tracker.device_timers.add(DeviceCount(tracker, name, tokens, seconds, rank, size))


@dataclass
class DeviceCount:
    """A throughput call whose tensor token count is not read yet."""

    view: Timed  # the tracker or prefixed view it was logged on
    name: str
    tokens: Tensor  # a float64 copy of the count, 0-d, on its device
    seconds: float
    rank: int
    world_size: int


@dataclass
class DeviceTimer:
    """A device timer whose events are not read yet."""

    view: Timed  # the tracker or prefixed view it was started on
    name: str
    start: Any
    end: Any
    rank: int
    world_size: int


@contextmanager
def timer(
    tracker: Timed,
    name: str,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    group: Any = None,
    device: str | torch.device | None = None,
    clock: Clock = time.perf_counter,
    events: EventFactory | None = None,
) -> Iterator[None]:
    """Time the block as this rank's entry into the stage ``name`` (logged on exit,
    also when the block raises).

    Args:
        tracker: a Tracker or a prefixed view.
        name: the metric, e.g. ``"timing_s/gen"``.
        rank, world_size, group: where this rank is (see the module docstring); resolved
            at entry, so a bad one fails before the work.
        device: a CUDA device to time device work with events (no wait in the block);
            None or any other device: the host ``clock`` (work queued on a device then
            needs a synchronise at the end of the block to be counted).
        clock: seconds, for host timing (tests inject one).
        events: an event factory instead of CUDA's (tests inject one).
    """
    rank, size = rank_and_size(name, rank, world_size, group)
    if events is None and (device is None or torch.device(device).type != "cuda"):
        start = clock()
        try:
            yield
        finally:
            log_elapsed(tracker, name, clock() - start, rank=rank, world_size=size)
        return
    stream = None
    if events is None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"metric {name!r}: device={device!r} timing needs CUDA, and "
                "torch sees no CUDA device"
            )
        stream = torch.cuda.current_stream(device)
        events = _cuda_events
    begin, end = events(), events()
    _record(begin, stream)
    try:
        yield
    finally:
        _record(end, stream)
        tracker.device_timers.add(DeviceTimer(tracker, name, begin, end, rank, size))


def _cuda_events() -> Any:
    return torch.cuda.Event(enable_timing=True)


def _record(event: Any, stream: Any) -> None:
    if stream is None:
        event.record()
    else:
        event.record(stream)


def _full_name(view: Timed, name: str) -> str:
    """``name`` as logged by ``view`` (a prefixed view adds its prefix)."""
    return getattr(view, "prefix", "") + name


class DeviceTimers:
    """A tracker's device timers and tensor token counts not read yet: ``timer`` and
    ``throughput`` hand them here, and the tracker's fold has them read and logged
    (``read``). ``logged_kind``: the kind name a metric of the tracker's step is logged
    as (None when it is not), so that a count of a name logged as another kind raises
    at its call, as a log call would. ``holding``: the tracker's lock, which ``add``
    takes as a log call does, so that an entry added while another thread ends the step
    lands whole in that step or the next (its fold reads the entries, its reset drops
    the rest)."""

    def __init__(
        self,
        logged_kind: Callable[[str], str | None],
        holding: Callable[[], AbstractContextManager[Any]],
    ) -> None:
        self.pending: list[DeviceTimer | DeviceCount] = []
        self.logged_kind = logged_kind
        self.holding = holding

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, entry: DeviceTimer | DeviceCount) -> None:
        """Keep a timer or a count until the fold.

        Raises:
            ValueError: a count's metric is already logged as another kind.
        """
        with self.holding():
            if isinstance(entry, DeviceCount):
                full = _full_name(entry.view, entry.name)
                kind = f"rank_throughput@{entry.world_size}"
                logged = self.logged_kind(full)
                if logged is not None and logged != kind:
                    raise ValueError(
                        f"metric {full!r} is already logged as kind {logged!r}; "
                        f"cannot log it as kind {kind!r}"
                    )
            self.pending.append(entry)

    def clear(self) -> None:
        """Drop everything not read yet (the tracker was reset)."""
        self.pending = []

    def read(self, wait: bool) -> None:
        """Log the pending timers and counts (the tracker's fold calls this): all of
        them, waiting for the device, with ``wait``; else the finished timers only (a
        count is read at the step's end).

        Raises:
            TokenCountError: naming each metric whose count was negative or not finite;
                those calls are dropped (logged with weight 0, so that the metric exists
                for a sync to count them as rejected), everything else is logged first.
        """
        pending, self.pending = self.pending, []
        unread: list[DeviceTimer | DeviceCount] = []
        counts: list[DeviceCount] = []
        for timer_ in pending:
            if isinstance(timer_, DeviceCount):
                (counts if wait else unread).append(timer_)
                continue
            if not wait and not timer_.end.query():
                unread.append(timer_)
                continue
            timer_.end.synchronize()
            seconds = timer_.start.elapsed_time(timer_.end) / 1000.0
            log_elapsed(
                timer_.view, timer_.name, seconds, rank=timer_.rank, world_size=timer_.world_size
            )
        self.pending[:0] = unread
        if counts:
            _log_counts(counts)


def _log_counts(counts: list[DeviceCount]) -> None:
    """Read the counts (one transfer per device) and log each call; raise for bad ones."""
    by_device: dict[torch.device, list[DeviceCount]] = {}
    for count in counts:
        by_device.setdefault(count.tokens.device, []).append(count)
    values: dict[int, float] = {}
    for group in by_device.values():
        read = torch.stack([c.tokens for c in group]).tolist()
        values.update(zip(map(id, group), read, strict=True))
    bad: dict[str, int] = {}
    messages = []
    for count in counts:
        tokens = values[id(count)]
        where = {"rank": count.rank, "world_size": count.world_size}
        if math.isfinite(tokens) and tokens >= 0:
            log_throughput(count.view, count.name, tokens, count.seconds, **where)
            continue
        kind, value, _ = throughput_record(count.name, 0.0, count.seconds, **where)
        count.view.log(count.name, value, np.zeros_like(value), kind=kind)
        full = _full_name(count.view, count.name)
        bad[full] = bad.get(full, 0) + 1
        messages.append(f"metric {full!r}: num_tokens must be finite and >= 0, got {tokens!r}")
    if bad:
        raise TokenCountError(
            "; ".join(messages) + " (a tensor count, read at the step's end); "
            "those throughput calls were dropped",
            bad,
        )
