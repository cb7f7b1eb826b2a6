"""docs/scaling.md's cost model (benchmarks/scaling_model.py) against the real thing: its
buffer sizes against rlmetrics' layouts, its collectives and bytes against what a
steady-state compute() issues over gloo."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmetrics import Tracker
from rlmetrics._engine.layout import BufferLayout
from rlmetrics._engine.sync import layout_sizes
from rlmetrics.kinds import get_kind
from rlmetrics.kinds.histogram import Histogram

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import scaling_model as model

from gloo_ranks import ok_results, run_ranks

KIND_NAMES = sorted(model.KIND_SLOTS)


@settings(max_examples=60, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(KIND_NAMES), max_size=40),
    edges=st.lists(st.integers(2, 300), max_size=3),
)
def test_buffer_sizes_equal_the_layouts(kinds: list[str], edges: list[int]) -> None:
    schema = [(f"m{i:03d}", get_kind(kind)) for i, kind in enumerate(kinds)]
    schema += [
        (f"h{i}", Histogram(name=f"scaling_h{i}", edges=np.linspace(0.0, 1.0, count)))
        for i, count in enumerate(edges)
    ]
    sizes = layout_sizes(BufferLayout(schema))
    buf = model.buffers(kinds, [count + 1 for count in edges])
    gather = sizes.sums + sizes.maxes  # the pair's SUM part adds a NaN count per MAX float
    assert (buf.gather, *buf.pair) == (gather, gather, sizes.maxes)


@pytest.mark.parametrize(
    ("total", "ranks"), [(8, 2), (8000, 4), (8 * 1001, 3), (3 << 20, 4), (24, 5)]
)
def test_ring_allreduce_sends_2_r_minus_1_over_r(total: int, ranks: int) -> None:
    sent = [model.gloo_ring_allreduce(total, ranks, rank)[0] for rank in range(ranks)]
    assert sum(sent) == 2 * (ranks - 1) * total  # every byte leaves R-1 ranks twice
    assert max(sent) - min(sent) <= 2 * 8 * ranks


def _issued(rank: int, world: int, n: int, dists: int) -> list[tuple[str, int]]:
    """(op, bytes per rank) of every collective of a steady-state compute()."""
    import torch.distributed as tdist

    tracker = Tracker()
    seen: list[tuple[str, int]] = []

    def step() -> None:
        for i, kind in enumerate(model.mix(n)):
            getattr(tracker, kind)(f"m{i:03d}", float(i if kind == "last" else rank + i))
        for i in range(dists):
            tracker.dist(f"d{i}", np.arange(5.0 + rank))
        tracker.compute()

    step()  # agrees the schema
    gather, reduce = tdist.all_gather, tdist.all_reduce
    tdist.all_gather = lambda out, t, **k: (
        seen.append(("all_gather", t.nbytes)) or gather(out, t, **k)
    )
    tdist.all_reduce = lambda t, **k: seen.append(("all_reduce", t.nbytes)) or reduce(t, **k)
    try:
        step()
    finally:
        tdist.all_gather, tdist.all_reduce = gather, reduce
    return seen


def _both(rank: int, world: int, n: int) -> list[list[tuple[str, int]]]:
    return [_issued(rank, world, n, dists) for dists in (0, 2)]


@pytest.mark.slow  # spawns gloo ranks: left out by `make test-fast`
def test_collectives_equal_the_model() -> None:
    """Scalars only (one gather), then with two dist metrics (and their extras gather:
    n values and n keep flags, padded to the largest rank's n)."""
    n, world = 7, 2
    got = ok_results(run_ranks(_both, world, n))
    for dists, seen in zip((0, 2), zip(*got, strict=True), strict=True):
        kinds = model.mix(n) + ["dist"] * dists
        extras = [model.dist_extra(5 + world - 1)] * dists
        want = model.rlmetrics_sync(model.buffers(kinds), world, "gather", extras)
        assert seen[0] == seen[1] == [(c.op, c.size) for c in want]
