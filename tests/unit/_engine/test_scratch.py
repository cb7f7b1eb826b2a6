"""The host fold's scratch (``rlmetrics._engine.plan.HostScratch``): float32 values and bool masks
are joined into buffers a tracker keeps from step to step, the values widened to
float64 while the unselected ones are zeroed. What a step reports is what it would be
without the scratch: numpy on the whole step, the same bits as the same values logged
as float64, and nothing a later fold writes reaches an earlier one's results."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmetrics import Tracker

KINDS = ("mean", "sum", "max", "min", "std", "dist")


def masked(seed: int, sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen), torch.rand(n, generator=gen) > 0.4) for n in sizes]


def numpy_truth(kind: str, calls: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    x = np.concatenate([v.numpy().astype(np.float64) for v, _ in calls])
    kept = x[np.concatenate([m.numpy() for _, m in calls])]
    return {
        "mean": kept.mean, "sum": kept.sum, "max": kept.max, "min": kept.min,
        "std": kept.std, "dist": kept.mean,
    }[kind]()  # fmt: skip


def scratch_buffers(tracker: Tracker) -> dict[object, np.ndarray]:
    return dict(tracker._plan.scratch._buffers)


@settings(max_examples=30, deadline=None)
@given(
    steps=st.lists(st.lists(st.integers(0, 3000), min_size=1, max_size=5), min_size=2, max_size=4),
    seed=st.integers(0, 1000),
)
def test_steps_of_any_sizes_report_numpy_on_each_whole_step(
    steps: list[list[int]], seed: int
) -> None:
    """Steps that grow and shrink reuse the buffers (each fold writes over the last
    one's), and each reports numpy over its own calls, every kind in one fold."""
    t = Tracker()
    for index, sizes in enumerate(steps):
        calls = masked(seed + index, sizes)
        for kind in KINDS:
            for value, mask in calls:
                getattr(t, kind)(kind, value, weight=mask)
        got = t.compute(sync=False)
        for kind in KINDS:
            key = "dist/mean" if kind == "dist" else kind
            want = numpy_truth(kind, calls) if sum(int(m.sum()) for _, m in calls) > 1 else None
            if want is None:
                continue  # an empty or one-element selection: covered elsewhere
            assert got[key] == pytest.approx(want, rel=1e-12, abs=1e-12), (kind, sizes)


def test_float32_values_report_the_bits_of_the_same_values_as_float64() -> None:
    """The narrow join, widened while zeroed, is the float64 batch of the same values:
    every kind reports the same bits."""
    calls = masked(3, [700, 20_000, 1, 4096])
    narrow, wide = Tracker(), Tracker()
    for kind in KINDS:
        for value, mask in calls:
            getattr(narrow, kind)(kind, value, weight=mask)
            getattr(wide, kind)(kind, value.double(), weight=mask)
    assert narrow.compute(sync=False) == wide.compute(sync=False)


def test_the_buffers_are_kept_across_steps_and_grown_only_when_too_small() -> None:
    t = Tracker()
    for sizes in ([5000, 3000], [100], [8000]):
        for value, mask in masked(0, sizes):
            t.mean("m", value, weight=mask)
        t.compute(sync=False)
        if sizes == [5000, 3000]:
            first = scratch_buffers(t)
            assert set(first) == {np.float32, np.bool_, np.float64}
    kept = scratch_buffers(t)
    assert all(kept[dtype] is first[dtype] for dtype in first)  # 8000 fits: no new one
    for value, mask in masked(1, [20_000]):
        t.mean("m", value, weight=mask)
    t.compute(sync=False)
    assert all(len(buffer) >= 20_000 for buffer in scratch_buffers(t).values())


def test_early_folds_of_one_step_keep_what_each_folded() -> None:
    """A step folded early (its record limit passed) folds several times into the same
    buffers: the distribution's values kept by the first fold are copies, so the step
    still reports numpy over all its calls."""
    calls = masked(5, [3000] * 6)
    t = Tracker()
    t.record_limit = 5000
    for value, mask in calls:
        t.dist("d", value, weight=mask)
        t.max("x", value, weight=mask)
    got = t.compute(sync=False)
    x = np.concatenate([v.numpy().astype(np.float64) for v, _ in calls])
    kept = x[np.concatenate([m.numpy() for _, m in calls])]
    assert got["d/mean"] == pytest.approx(kept.mean(), rel=1e-12)
    assert got["d/max"] == kept.max() == got["x"]
    assert got["d/p50"] == pytest.approx(np.quantile(kept, 0.5), rel=0.02)


def test_non_finite_values_behind_the_mask_stay_out_and_selected_ones_propagate() -> None:
    """The zeroing's finite check on the narrow values: a NaN or infinity that is not
    selected contributes nothing; one that is selected propagates (the default)."""
    value = torch.tensor([1.0, float("nan"), 3.0, float("inf"), 5.0])
    hidden = torch.tensor([True, False, True, False, True])
    shown = torch.tensor([True, True, True, False, True])
    t = Tracker()
    t.mean("hidden", value, weight=hidden)
    t.sum("hidden_sum", value, weight=hidden)
    t.mean("shown", value, weight=shown)
    got = t.compute(sync=False)
    assert got["hidden"] == 3.0 and got["hidden_sum"] == 9.0
    assert math.isnan(got["shown"])
    huge = torch.full((4,), 3e38)  # a float32 sum past float32's range: finite values
    t.sum("huge", huge, weight=torch.ones(4, dtype=torch.bool))
    assert t.compute(sync=False)["huge"] == pytest.approx(4 * float(huge[0]), rel=1e-12)


def test_a_buffer_recent_folds_used_little_of_is_given_back() -> None:
    """One huge step does not keep its memory for the rest of the run: after
    ``SHRINK_AFTER`` folds in a row that use under an eighth of a buffer, it is made
    the size they need; one fold that needs more in between keeps it."""
    from rlmetrics._engine.plan import SCRATCH_GROWTH as GROWTH
    from rlmetrics._engine.plan import SCRATCH_SHRINK_AFTER as SHRINK_AFTER

    t = Tracker()
    huge = masked(0, [100_000])
    small = masked(1, [1000])

    def step(calls: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for value, mask in calls:
            t.mean("m", value, weight=mask)
        t.compute(sync=False)

    step(huge)
    for _ in range(SHRINK_AFTER - 1):
        step(small)
    step(huge)  # needed again: kept, the count starts over
    for _ in range(SHRINK_AFTER - 1):
        step(small)
    assert len(scratch_buffers(t)[np.float32]) >= 100_000
    step(small)
    assert len(scratch_buffers(t)[np.float32]) == 1000 + 1000 // GROWTH
