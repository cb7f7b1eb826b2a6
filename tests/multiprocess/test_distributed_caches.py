"""Ranks whose trackers cache different layouts (or none) still sync, over real gloo ranks.

A tracker created or unpickled on one rank only has no cached layout while its peers
have one; a tracker swapped for another caches another layout. Every mix must pair the
same collectives on every rank and give the single-process result.

The three checks share one spawned pair of ranks (``gloo_ranks.run_together``); each
schedule runs over a group of its own, so it starts with nothing agreed.
"""

from __future__ import annotations

import math
import pickle
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from rlmetrics import Tracker
from rlmetrics._engine import sync as rd
from rlmetrics._engine.packing import Packing
from rlmetrics._engine.sync import RECENT

from gloo_ranks import count_collectives, ok_results, run_together

Calls = list[tuple[str, str, float]]

# One step: per rank, (tracker key, what happens to it, calls). "keep" logs into the
# rank's tracker of that key; "new" replaces it by a fresh Tracker first; "pickle" logs,
# then replaces it by a pickled-and-loaded copy (no sync cache, same metrics).
Step = tuple[tuple[str, str, Calls], tuple[str, str, Calls]]
AB: Calls = [("a", "mean", 1.0), ("b", "max", 2.0)]
AB1: Calls = [("a", "mean", 3.0), ("b", "max", -1.0)]
C: Calls = [("c", "sum", 5.0)]
STEPS: list[tuple[str, Step]] = [
    ("first step", (("A", "keep", AB), ("A", "keep", AB1))),
    ("steady", (("A", "keep", AB), ("A", "keep", AB1))),
    ("another tracker, another layout", (("B", "keep", C), ("B", "keep", C))),
    ("alternating trackers, steady", (("A", "keep", AB), ("A", "keep", AB1))),
    ("rank 1 fresh, same names", (("A", "keep", AB), ("A", "new", AB1))),
    ("rank 0 fresh, same names", (("A", "new", AB), ("A", "keep", AB1))),
    ("rank 1 unpickled", (("A", "keep", AB), ("A", "pickle", AB1))),
    ("rank 0 unpickled", (("A", "pickle", AB), ("A", "keep", AB1))),
    ("both unpickled", (("A", "pickle", AB), ("A", "pickle", AB1))),
    ("rank 1 fresh, a new name", (("A", "keep", AB), ("A", "new", [("z", "min", 4.0)]))),
    ("rank 0 fresh, nothing logged", (("A", "new", []), ("A", "keep", AB1))),
    ("rank 1 cache of another layout", (("A", "keep", AB), ("B", "keep", C))),
    ("rank 1 schema changed", (("A", "keep", AB), ("A", "keep", [*AB1, ("d", "sum", 1.0)]))),
    ("rank 0 other tracker, new name", (("B", "keep", [("e", "max", 7.0)]), ("A", "keep", AB))),
    ("after the changes", (("A", "keep", AB), ("A", "keep", AB1))),  # caches differ: agree
    ("after the changes, steady", (("A", "keep", AB), ("A", "keep", AB1))),
]
# steps whose collective count is pinned on the one-gather path
COUNTS = {
    "first step": 3,  # agreement (2 byte gathers), then the gather
    "steady": 1,
    "alternating trackers, steady": 1,
    "rank 1 fresh, same names": 1,  # its guess is its peers' layout
    "rank 1 unpickled": 1,
    "rank 1 fresh, a new name": 4,  # the gather says "changed", agreement, gather again
    "after the changes, steady": 1,
    "steady again": 1,
}


@pytest.fixture(scope="module")
def pair() -> dict[str, Any]:
    """Every check's rank function, run in turn on one spawned pair of gloo ranks."""
    calls = {
        "mixed_caches/None": (mixed_caches, (None,)),
        "mixed_caches/0": (mixed_caches, (0,)),
        "misuse": (misuse, ()),
        "sets_in_turn": (sets_in_turn, ()),
    }
    return run_together(calls, 2, timeout=600)


def log_calls(tracker: Tracker, calls: Calls) -> None:
    for name, kind, value in calls:
        tracker.log(name, value, kind=kind)


def schedule() -> list[tuple[str, Step]]:
    """STEPS, then more trackers than a group keeps layouts for, then tracker A again
    (its layout dropped from the group's recent ones), fresh on rank 1."""
    evicting = [
        ("evicting", ((f"T{i}", "keep", [(f"t{i}", "sum", 1.0)]),) * 2) for i in range(RECENT + 1)
    ]
    again = [
        ("evicted, rank 1 fresh", (("A", "keep", AB), ("A", "new", AB1))),
        ("steady again", (("A", "keep", AB), ("A", "keep", AB1))),
    ]
    return STEPS + evicting + again


def mixed_caches(rank: int, world: int, limit: int | None) -> list[tuple[dict, int]]:
    """Run ``schedule()`` on this rank: (result, collectives) per step, over a new group
    of both ranks (nothing agreed over it yet, as in a fresh process)."""
    group = dist.new_group([0, 1])
    with pytest.MonkeyPatch.context() as patch:
        if limit is not None:
            patch.setattr(rd, "GATHER_LIMIT", limit)
        counts = count_collectives(patch)
        trackers: dict[str, Tracker] = {}
        out = []
        for _, step in schedule():
            key, action, calls = step[rank]
            if action == "new" or key not in trackers:
                trackers[key] = Tracker()
            log_calls(trackers[key], calls)
            if action == "pickle":
                trackers[key] = pickle.loads(pickle.dumps(trackers[key]))
            before = counts["n"]
            result = trackers[key].compute(group=group, timeout=30)
            out.append((result, counts["n"] - before))
    return out


def single_process(step: Step) -> dict:
    tracker = Tracker()
    for _, _, calls in step:
        log_calls(tracker, calls)
    return tracker.compute()


@pytest.mark.parametrize("limit", [None, 0], ids=["one_gather", "all_reduce_pair"])
def test_ranks_with_different_or_no_cached_layouts_sync(
    pair: dict[str, Any], limit: int | None
) -> None:
    """Each step equals one process logging both ranks' calls, on both ranks, whatever
    each rank's tracker caches; the steady state stays one collective."""
    rank0, rank1 = ok_results(pair[f"mixed_caches/{limit}"])
    for (label, step), (got0, count0), (got1, count1) in zip(schedule(), rank0, rank1, strict=True):
        assert got0 == got1 == single_process(step), label
        assert count0 == count1, label
        if limit is None and label in COUNTS:
            assert count0 == COUNTS[label], label


def misuse(rank: int, world: int) -> dict[str, str]:
    """compute() over a group this rank is not in, and with edge-case timeouts."""
    out = {}
    outside = dist.new_group([0])  # rank 1 is not a member
    tracker = Tracker()
    tracker.mean("x", float(rank))
    if rank == 1:
        try:
            tracker.compute(group=outside)
        except ValueError as error:
            out["outside"] = str(error)
        assert "x" in tracker  # nothing was reset
    else:
        out["outside"] = repr(tracker.compute(group=outside, reset=False))
    out["inf"] = repr(tracker.compute(timeout=math.inf))
    tracker.mean("x", 1.0)
    out["huge"] = repr(tracker.compute(timeout=timedelta(days=999_999_999)))
    for bad in (0, -1.0, math.nan, timedelta(0)):
        tracker.mean("x", 1.0)
        try:
            tracker.compute(timeout=bad)
        except ValueError as error:
            out[repr(bad)] = str(error)
    return out


def test_group_non_member_and_timeouts(pair: dict[str, Any]) -> None:
    """A rank outside the group gets a ValueError that says so (its peers are not left
    waiting: torch issues nothing for non-members); ``math.inf`` and huge timeouts mean
    no bound of rlmetrics', and zero, negative or NaN ones are rejected."""
    rank0, rank1 = ok_results(pair["misuse"])
    assert rank0["outside"] == "{'x': 0.0}"
    assert "not a member of the process group" in rank1["outside"]
    assert "GroupMember.NON_GROUP_MEMBER" in rank1["outside"]
    for out in (rank0, rank1):
        assert out["inf"] == "{'x': 0.5}"
        assert out["huge"] == "{'x': 1.0}"
        for bad in ("0", "-1.0", "nan", "datetime.timedelta(0)"):
            assert out[bad].startswith("timeout must be > 0 seconds"), bad


def sets_in_turn(rank: int, world: int) -> list[tuple[dict, int, int]]:
    """Steps that log two sets of metrics in turn (rank 1 logs the rewards of the first
    set alone), over a new group: (result, collectives, packings made) per step."""
    group = dist.new_group([0, 1])
    made = {"n": 0}
    make = Packing.make.__func__  # type: ignore[attr-defined]

    def counted(cls: type, *args: Any, **kwargs: Any) -> Packing:
        made["n"] += 1
        return make(cls, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Packing, "make", classmethod(counted))
        counts = count_collectives(patch)
        tracker, out = Tracker(), []
        for step in range(8):
            tracker.mean("a", float(rank + step))
            tracker.max("b", float(rank * step))
            if step % 2 == 0 and rank == 1:
                tracker.mean("reward", float(step))
            before, packed = counts["n"], made["n"]
            result = tracker.compute(group=group, timeout=30)
            out.append((result, counts["n"] - before, made["n"] - packed))
    return out


def test_metric_sets_logged_in_turn_keep_their_packings(pair: dict[str, Any]) -> None:
    """Each set's packing is made once and reused when the set comes back; every step is
    one collective after the first agreement and equals a single process's result."""
    rank0, rank1 = ok_results(pair["sets_in_turn"])
    for step, ((result0, count0, _), (result1, count1, _)) in enumerate(
        zip(rank0, rank1, strict=True)
    ):
        expected = {"a": step + 0.5, "b": float(step)}
        if step % 2 == 0:
            expected["reward"] = float(step)
        assert result0 == result1 == expected, step
        assert count0 == count1 == (3 if step == 0 else 1), step
    assert [packings for _, _, packings in rank0] == [1, 0, 0, 0, 0, 0, 0, 0]  # one set
    assert [packings for _, _, packings in rank1] == [1, 1, 0, 0, 0, 0, 0, 0]  # two, in turn
