"""Per-rank slots: rank-aware stage timings and throughput (see ``rlmetrics.timing``).

A stage's time is a per-rank quantity: the step waits for the slowest rank, and load
imbalance is the spread between ranks. These kinds keep one additive slot per rank, so
each rank's total time in the step stays apart however its calls were folded and
however the states were merged (sums add; the rank is the slot, not the order), and
the slowest rank's total is exact. Everything is a sum: the kinds ride in the step's
one packed collective.

They form families named by the group's size R, ``rank_time@R`` and
``rank_throughput@R`` (the same R on every rank, so the schema agrees): ``get_kind``
makes a family's member on first use (``family_kind``), in any process.

A call holds ``parts`` equal chunks, one per slot: chunk i is rank i's. The logging
helpers send one element per chunk: the seconds at this rank's position with weight
1, zeros with weight 0 elsewhere; ``rank_throughput@R`` appends the tokens (weight 1).
The state is ``[Σ value·weight per chunk, Σ weight per chunk]``: per rank, its seconds
and its number of timed entries (the entries tell a rank that spent 0 s from one that
did not time the stage).
"""

from __future__ import annotations

import numpy as np

from rlmetrics.kinds.base import Kind, MetricState
from rlmetrics.kinds.batch import Array, Batch


class PerRank(Kind):
    """Base of the per-rank kinds: ``parts`` chunks per call, each summed with its
    weights into its own pair of slots.

    Args:
        world_size: the number of ranks R (>= 1).
    """

    family = ""
    extra_parts = 0  # chunks after the R per-rank ones

    def __init__(self, world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(
                f"{type(self).__name__}: world_size must be an int >= 1, got {world_size!r}"
            )
        self.world_size = world_size
        self.name = f"{self.family}@{world_size}"
        self.parts = world_size + self.extra_parts
        self.num_sums = 2 * self.parts

    def reduce(self, batch: Batch) -> tuple[Array, Array]:
        """Per metric and chunk: Σ value·weight, then Σ weight."""
        parts, rows = self.parts, batch.num_rows
        keys = batch.segments * parts + batch.chunk_index(parts)
        weights = batch.weights
        totals = batch.sum_by(batch.values * weights, keys, rows * parts)
        counts = batch.sum_by(weights, keys, rows * parts)
        return batch.concat(totals.reshape(rows, parts), counts.reshape(rows, parts)), (
            batch.columns()
        )

    def per_rank(self, state: MetricState) -> tuple[np.ndarray, np.ndarray]:
        """(seconds, entries) of each rank, from a state."""
        sums, size, parts = np.asarray(state.sums, dtype=np.float64), self.world_size, self.parts
        return sums[:size], sums[parts : parts + size]

    def config(self) -> tuple:
        return (self.name,)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size})"


class RankTime(PerRank):
    """A stage's time per rank; reports the slowest rank's and how the ranks spread.

    Results, for a metric ``name`` (over the ranks that timed the stage in the step):
    ``name`` the largest rank total (the slowest rank's time: what the step waited
    for), ``name/mean`` their mean, ``name/min`` the smallest, ``name/slowest_rank``
    the slowest rank's index (the lowest index on a tie). A rank's total is the sum of
    its entries in the step.

    Examples:
        >>> from rlmetrics import Tracker
        >>> t = Tracker()
        >>> t.log("timing_s/gen", [0.0, 3.0], [0, 1], kind="rank_time@2")  # rank 1: 3 s
        >>> t.log("timing_s/gen", [1.0, 0.0], [1, 0], kind="rank_time@2")  # rank 0: 1 s
        >>> out = t.compute()
        >>> out["timing_s/gen"], out["timing_s/gen/mean"], out["timing_s/gen/slowest_rank"]
        (3.0, 2.0, 1.0)
    """

    family = "rank_time"

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        seconds, entries = self.per_rank(state)
        present = entries > 0
        if not present.any():
            return None
        slowest = int(np.argmax(np.where(present, seconds, -np.inf)))  # NaN wins
        return {
            "": float(seconds[slowest]),
            "mean": float(seconds[present].sum() / present.sum()),
            "min": float(np.where(present, seconds, np.inf).min()),
            "slowest_rank": float(slowest),
        }

    def result_names(self) -> tuple[str, ...]:
        return ("", "mean", "min", "slowest_rank")


class RankThroughput(PerRank):
    """Tokens per second from the summed tokens and the slowest rank's time.

    State: per rank its seconds (and entries), plus the tokens of all calls (and their
    number). Results: ``name`` = Σ tokens / (T · n), tokens per second per rank (verl's
    per-GPU ``perf/throughput``), and ``name/total`` = Σ tokens / T, the group's tokens
    per second, where T is the slowest rank's time (its seconds summed over its calls)
    and n the number of ranks that logged. Never a mean of per-rank rates, which
    over-states the rate whenever the ranks' times differ.

    Examples:
        >>> from rlmetrics import Tracker
        >>> t = Tracker()
        >>> t.log("perf/throughput", [2.0, 0.0, 60.0], [1, 0, 1], kind="rank_throughput@2")
        >>> t.log("perf/throughput", [0.0, 4.0, 40.0], [0, 1, 1], kind="rank_throughput@2")
        >>> t.compute()
        {'perf/throughput': 12.5, 'perf/throughput/total': 25.0}
    """

    family = "rank_throughput"
    extra_parts = 1

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        seconds, entries = self.per_rank(state)
        present = entries > 0
        if not present.any():
            return None
        with np.errstate(divide="ignore", invalid="ignore"):  # a 0 s time: inf (or NaN)
            total = np.float64(state.sums[self.world_size]) / seconds[present].max()
        return {"": float(total / present.sum()), "total": float(total)}

    def result_names(self) -> tuple[str, ...]:
        return ("", "total")


FAMILIES: dict[str, type[PerRank]] = {cls.family: cls for cls in (RankTime, RankThroughput)}


def family_kind(name: str) -> PerRank | None:
    """The member of a per-rank family that ``name`` ("rank_time@4") names, or None when
    ``name`` is not of a family.

    Raises:
        ValueError: the family is known but the size after "@" is not an int >= 1.
    """
    family, at, size = name.partition("@")
    cls = FAMILIES.get(family)
    if cls is None or not at:
        return None
    if not (size.isdigit() and size == str(int(size)) and int(size) >= 1):
        raise ValueError(
            f"kind {name!r}: the {family!r} family takes the group's size after '@', an "
            f"int >= 1 (e.g. '{family}@4'), got {size!r}"
        )
    return cls(int(size))
