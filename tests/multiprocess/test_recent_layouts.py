"""A recent agreed layout reused, over real gloo ranks: a tracker that comes back to a set
of names every rank agreed on pays one collective, not an agreement; ranks that pick
different layouts (other recent sets, a new name, an evicted layout) agree again on
every rank, and a rank that logged nothing follows its peers' layout; every step reports
what numpy computes over both ranks' values, on both ranks, with no hang.

Every check runs on one spawned pair of ranks (``gloo_ranks.run_together``), each
schedule over a group of its own, so each starts with nothing agreed.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rlmetrics import Tracker
from rlmetrics._engine import sync as rd
from rlmetrics._engine.sync import RECENT

from gloo_ranks import count_collectives, ok_results, run_together

KINDS = ("mean", "sum", "max", "min")
NUMPY = {"mean": np.mean, "sum": np.sum, "max": np.max, "min": np.min}
STD_SET = 99  # the set with a std metric: its extras take one gather more per reduce

# A step: per rank, the sets it logs (a set ``i`` is ``set{i}/<kind>`` for each kind of
# KINDS, or ``std/x`` for STD_SET), or "fresh" (logs set 0 into a new Tracker).
Ranks = tuple[Any, Any]


def cycle(sets: int) -> list[tuple[str, Ranks, int]]:
    """``sets`` disjoint sets in turn, three rounds, the same set on both ranks: the
    group's first step agrees (2 byte gathers) and gathers; each set's first step
    gathers, agrees and gathers again; every later step is the one gather."""
    steps = []
    for step in range(3 * sets):
        count = 3 if step == 0 else 4 if step < sets else 1
        steps.append((f"cycle of {sets}, step {step}", (([step % sets],) * 2), count))
    return steps


A, B, C = [0], [1], [2]
MIXTURES: list[tuple[str, Ranks, int]] = [
    ("A", (A, A), 3),
    ("B", (B, B), 4),
    ("A again", (A, A), 1),
    ("A and B, both recent", (A, B), 4),  # other layouts: the tail's digests differ
    ("A and B again: their union is recent", (A, B), 1),
    ("B on both: the union holds it", (B, B), 1),
    ("a new name on rank 1", (A, [0, 2]), 4),
    ("rank 0 empty", ([], B), 1),  # it follows rank 1's layout
    ("rank 1 empty", (C, []), 1),
    ("both empty", ([], []), 1),
    ("rank 1 fresh tracker", (A, "fresh"), 1),
    ("std set", ([STD_SET], [STD_SET]), 4 + 1),  # each gather of states adds the extras'
    ("std set and C", ([STD_SET], C), 4 + 1),
    ("rank 0 empty beside the std set", ([], [STD_SET]), 1 + 1),
    *((f"evicting, set {i}", ([i], [i]), 4) for i in range(10, 10 + RECENT)),
    ("A, evicted; rank 1 fresh", (A, "fresh"), 4),
    ("A, recent again", (A, A), 1),
    ("B, evicted, on rank 0 only", (B, []), 4),
]


@pytest.fixture(scope="module")
def pair() -> dict[str, Any]:
    """Every schedule's outcome, run in turn on one spawned pair of gloo ranks."""
    calls: dict[str, Any] = {
        f"cycle/{sets}": (run_schedule, (cycle(sets), None)) for sets in (2, 3, 4)
    }
    calls[f"cycle/{RECENT + 1}"] = (run_schedule, (cycle(RECENT + 1), None))
    calls["mixtures/None"] = (run_schedule, (MIXTURES, None))
    calls["mixtures/0"] = (run_schedule, (MIXTURES, 0))
    calls["trackers in turn"] = (trackers_in_turn, ())
    return run_together(calls, 2, timeout=600)


def values(step: int, rank: int, name: str) -> np.ndarray:
    """A rank's values of ``name`` at ``step``: multiples of 1/8 whose sums are exact."""
    seed = [step, rank, *name.encode()]
    rng = np.random.default_rng(seed)
    return rng.integers(-64, 64, size=int(rng.integers(1, 9))) / 8.0


def names(sets: Any) -> list[tuple[str, str]]:
    """(name, kind) of every metric a rank's sets hold."""
    if sets == "fresh":
        sets = A
    out = []
    for i in sets:
        out += [("std/x", "std")] if i == STD_SET else [(f"set{i}/{k}", k) for k in KINDS]
    return out


def run_schedule(
    rank: int, world: int, steps: list[tuple[str, Ranks, int]], limit: int | None
) -> list[tuple[dict[str, float], int]]:
    """This rank's (result, collectives) per step, over a new group (``limit``: the
    gather limit, 0 for the all_reduce pair)."""
    group = dist.new_group([0, 1])
    with pytest.MonkeyPatch.context() as patch:
        if limit is not None:
            patch.setattr(rd, "GATHER_LIMIT", limit)
        counts = count_collectives(patch)
        tracker, out = Tracker(), []
        for step, (_, sets, _) in enumerate(steps):
            if sets[rank] == "fresh":
                tracker = Tracker()
            for name, kind in names(sets[rank]):
                tracker.log(name, torch.from_numpy(values(step, rank, name)), kind=kind)
            before = counts["n"]
            result = tracker.compute(group=group, timeout=60)
            out.append((result, counts["n"] - before))
    return out


def expected(step: int, sets: Ranks) -> dict[str, float]:
    """numpy over both ranks' values, per name logged on either rank."""
    out: dict[str, float] = {}
    for name, kind in {pair for ranked in sets for pair in names(ranked)}:
        both = np.concatenate(
            [values(step, rank, name) for rank in (0, 1) if (name, kind) in names(sets[rank])]
        )
        out[name] = float(np.std(both) if kind == "std" else NUMPY[kind](both))
    return out


def check(outcome: dict[int, tuple[str, Any]], steps: list[tuple[str, Ranks, int]]) -> list[int]:
    """Both ranks report numpy's values at every step (std to 1e-12, the rest exactly)
    and take the same collectives; the collectives per step."""
    rank0, rank1 = ok_results(outcome)
    per_step = []
    for step, ((label, sets, _), (got0, count0), (got1, count1)) in enumerate(
        zip(steps, rank0, rank1, strict=True)
    ):
        assert got0 == got1, label
        want = expected(step, sets)
        assert sorted(got0) == sorted(want), label
        for name, value in want.items():
            if name.startswith("std/"):
                assert math.isclose(got0[name], value, rel_tol=1e-12), (label, name)
            else:
                assert got0[name] == value, (label, name)
        assert count0 == count1, label
        per_step.append(count0)
    return per_step


@pytest.mark.parametrize("sets", [2, 3, 4])
def test_a_cycle_of_sets_costs_one_collective_a_step(pair: dict[str, Any], sets: int) -> None:
    """After each set's first agreement, every step of the cycle is one gather."""
    steps = cycle(sets)
    assert check(pair[f"cycle/{sets}"], steps) == [count for _, _, count in steps]


def test_a_cycle_longer_than_the_recent_layouts_agrees_every_step(pair: dict[str, Any]) -> None:
    """With more sets than the group keeps, each comes back evicted: agreed again, right."""
    counts = check(pair[f"cycle/{RECENT + 1}"], cycle(RECENT + 1))
    assert counts == [3] + [4] * (3 * (RECENT + 1) - 1)


@pytest.mark.parametrize("limit", [None, 0], ids=["one_gather", "all_reduce_pair"])
def test_ranks_that_pick_different_layouts_agree_again(
    pair: dict[str, Any], limit: int | None
) -> None:
    """Ranks on different recent sets, a new name, an evicted layout: every rank agrees
    again; a rank that logged nothing follows its peers' layout within the one
    collective. Each step equals numpy over both ranks' values."""
    counts = check(pair[f"mixtures/{limit}"], MIXTURES)
    if limit is None:
        assert counts == [count for _, _, count in MIXTURES]


def trackers_in_turn(rank: int, world: int) -> list[tuple[dict[str, float], int]]:
    """Two trackers that log the same names, a ``dist`` among them, take turns over a new
    group: (result, collectives) per step."""
    group = dist.new_group([0, 1])
    with pytest.MonkeyPatch.context() as patch:
        counts = count_collectives(patch)
        trackers, out = (Tracker(), Tracker()), []
        for step in range(6):
            tracker = trackers[step % 2]
            tracker.log("d", torch.from_numpy(values(step, rank, "d")), kind="dist")
            tracker.mean("m", torch.from_numpy(values(step, rank, "m")))
            before = counts["n"]
            out.append((tracker.compute(group=group, timeout=60), counts["n"] - before))
    return out


def test_trackers_in_turn_keep_their_own_copies_of_a_layout(pair: dict[str, Any]) -> None:
    """Each tracker's ``dist`` is its own kind object, so the second tracker agrees once
    on the layout the first agreed; after that each packs its own copy: one gather of
    states and one of extras a step. Values are numpy's over both ranks."""
    rank0, rank1 = ok_results(pair["trackers in turn"])
    for step, ((got0, count0), (got1, count1)) in enumerate(zip(rank0, rank1, strict=True)):
        assert got0 == got1
        d, m = (np.concatenate([values(step, r, name) for r in (0, 1)]) for name in ("d", "m"))
        assert got0["m"] == np.mean(m)
        assert (got0["d/mean"], got0["d/min"], got0["d/max"]) == (d.mean(), d.min(), d.max())
        assert count0 == count1 == [4, 5, 2, 2, 2, 2][step], step
