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


def scratch_buffers(tracker: Tracker) -> dict[object, object]:
    """Per dtype, the scratch's buffer: an array (``take``), or for the joins of CPU
    tensors' copies a ``BytesIO`` (``joined``)."""
    scratch = tracker._plan.scratch
    return {**scratch._buffers, **scratch._files}


def held(tracker: Tracker) -> dict[object, int]:
    """Per dtype, the elements its scratch buffer holds."""
    return {
        dtype: len(buffer)
        if isinstance(buffer, np.ndarray)
        else buffer.getbuffer().nbytes // np.dtype(dtype).itemsize
        for dtype, buffer in scratch_buffers(tracker).items()
    }


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
    assert all(size >= 20_000 for size in held(t).values())


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
    assert held(t)[np.float32] >= 100_000 and held(t)[np.float64] >= 100_000
    step(small)
    assert held(t)[np.float32] == 1000  # a join's file: as large as written
    assert held(t)[np.float64] == 1000 + 1000 // GROWTH


def test_a_join_still_viewed_is_not_written_over() -> None:
    """``HostScratch.joined`` writes a new file while an array of the last join is
    still held (a fold that did not end), and the held array keeps its elements."""
    from rlmetrics._engine.plan import HostScratch

    scratch = HostScratch()
    first = [np.arange(4, dtype=np.float32).tobytes(), np.arange(4, 6, dtype=np.float32).tobytes()]
    held_array = scratch.joined(first, np.float32, 6)
    assert held_array.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    second = scratch.joined([np.full(6, 9.0, dtype=np.float32).tobytes()], np.float32, 6)
    assert held_array.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert second.tolist() == [9.0] * 6
    del held_array, second
    file = scratch._files[np.float32]
    third = scratch.joined([np.ones(3, dtype=np.float32).tobytes()], np.float32, 3)
    assert scratch._files[np.float32] is file  # no view left: the same file, written over
    assert third.tolist() == [1.0] * 3 and third.flags.writeable


@pytest.mark.parametrize("kind", KINDS)
def test_copies_of_several_dtypes_and_arrays_in_one_step_report_numpy(kind: str) -> None:
    """CPU tensors of several dtypes, numpy arrays and float weights mixed in one
    metric's step: the copies that are not joined as bytes are read as arrays."""
    gen = torch.Generator().manual_seed(7)
    x32, x64 = torch.randn(300, generator=gen), torch.randn(200, generator=gen).double()
    xi = torch.randint(-5, 5, (100,), generator=gen)
    m32, m64 = torch.rand(300, generator=gen) > 0.5, torch.rand(200, generator=gen) > 0.5
    array = np.linspace(-1.0, 1.0, 50)
    t = Tracker()
    log = getattr(t, kind)
    log("m", x32, weight=m32)
    log("m", x64, weight=m64)
    log("m", xi)
    log("m", array)
    log("m", x32, weight=m32.float() * 2.0 if kind in ("mean", "sum", "std") else m32)  # float
    got = t.compute(sync=False)
    x = np.concatenate([x32.numpy(), x64.numpy(), xi.numpy(), array, x32.numpy()])
    scale = 2.0 if kind in ("mean", "sum", "std") else 1.0
    w = np.concatenate([m32.numpy(), m64.numpy(), np.ones(150), m32.numpy() * scale])
    kept = x[w > 0]
    want = {
        "mean": (x * w).sum() / w.sum(), "sum": (x * w).sum(), "max": kept.max(),
        "min": kept.min(), "dist": kept.mean(),
        "std": np.sqrt((w * (x - (x * w).sum() / w.sum()) ** 2).sum() / w.sum()),
    }[kind]  # fmt: skip
    key = "m/mean" if kind == "dist" else "m"
    assert got[key] == pytest.approx(want, rel=1e-12)
