"""The host fold's memory kept from step to step: CPU tensors' copies written into each
metric's arenas (``rlmetrics._engine.copies.CopyArena``), and the scratch
(``rlmetrics._engine.plan.HostScratch``) that several metrics' float32 values and bool
masks are joined into, the values widened to float64 while the unselected ones are
zeroed. What a step reports is what it would be without them: numpy on the whole step,
the same bits as the same values logged as float64, and nothing a later fold or log
call writes reaches an earlier one's results."""

from __future__ import annotations

import copy
import math
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmetrics import Tracker
from rlmetrics._engine.copies import ARENA_GROWTH, ARENA_SHRINK_AFTER, CopyArena

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
    """Per dtype, the scratch's buffer."""
    return dict(tracker._plan.scratch._buffers)


def held(tracker: Tracker) -> dict[object, int]:
    """Per dtype, the elements its scratch buffer holds."""
    return {dtype: len(buffer) for dtype, buffer in scratch_buffers(tracker).items()}


def arena(tracker: Tracker, name: str, side: str = "value") -> CopyArena:
    """The arena a metric's log calls copied CPU tensors' values (or weights) into."""
    copies = getattr(tracker._pool[name], f"{side}_copies")
    assert isinstance(copies, CopyArena)
    return copies


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
    """Two metrics' copies are joined into the scratch."""
    t = Tracker()
    for sizes in ([5000, 3000], [100], [8000]):
        for value, mask in masked(0, sizes):
            t.mean("m", value, weight=mask)
            t.mean("n", value, weight=mask)
        t.compute(sync=False)
        if sizes == [5000, 3000]:
            first = scratch_buffers(t)
            assert set(first) == {np.float32, np.bool_, np.float64}
    kept = scratch_buffers(t)
    assert all(kept[dtype] is first[dtype] for dtype in first)  # 8000 fits: no new one
    for value, mask in masked(1, [20_000]):
        t.mean("m", value, weight=mask)
        t.mean("n", value, weight=mask)
    t.compute(sync=False)
    assert all(size >= 40_000 for size in held(t).values())


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
            t.mean("m", value, weight=mask)  # two metrics: joined into the scratch
            t.mean("n", value, weight=mask)
        t.compute(sync=False)

    step(huge)
    for _ in range(SHRINK_AFTER - 1):
        step(small)
    step(huge)  # needed again: kept, the count starts over
    for _ in range(SHRINK_AFTER - 1):
        step(small)
    assert held(t)[np.float32] >= 200_000 and held(t)[np.float64] >= 200_000
    step(small)
    assert held(t)[np.float32] == held(t)[np.float64] == 2000 + 2000 // GROWTH


def test_one_metrics_copies_are_folded_where_they_were_written() -> None:
    """One metric's masked copies fold from its arenas, not the scratch (no float32 or
    bool buffer is taken), and the arenas keep their files from step to step."""
    t = Tracker()
    files = None
    for seed in range(3):
        calls = masked(seed, [700, 1, 2000])
        for value, mask in calls:
            t.mean("m", value, weight=mask)
        got = t.compute(sync=False)["m"]
        assert got == pytest.approx(numpy_truth("mean", calls), rel=1e-12)
        assert np.float32 not in scratch_buffers(t) and np.bool_ not in scratch_buffers(t)
        now = (arena(t, "m").file, arena(t, "m", "weight").file)
        assert files is None or now == files
        files = now


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_tracker_copies_a_reused_buffer_as_it_is_now(how: str) -> None:
    """A tensor logged again from the same memory is read through a view of that
    memory. A deep copy or an unpickled copy of the tracker holds no such view (a
    pickled array is a copy of the elements then): it logs the buffer's elements now."""
    buffer = torch.ones(100)
    t = Tracker()
    for _ in range(3):  # the second copy from this memory makes the view
        t.mean("m", buffer)
    assert t.compute(sync=False)["m"] == 1.0
    t.mean("m", buffer)
    copied = copy.deepcopy(t) if how == "deepcopy" else pickle.loads(pickle.dumps(t))
    buffer.fill_(5.0)
    for _ in range(2):
        copied.mean("m", buffer)
    assert copied.compute(sync=False)["m"] == pytest.approx(11 / 3)  # the step's 1, 5, 5
    copied.mean("m", buffer)
    assert copied.compute(sync=False)["m"] == 5.0


def test_an_arena_still_viewed_is_not_written_over() -> None:
    """A step's copies read as an array past the fold (held by a caller, say a
    traceback) keep their elements: the next step's copies go into a new file."""
    from rlmetrics._engine.copies import as_array

    t = Tracker()
    first = torch.arange(6, dtype=torch.float32)
    t.mean("m", first)
    record = t._metric_records["m"].values[0]
    held_array = as_array(record)
    assert t.compute(sync=False)["m"] == 2.5
    old_file = arena(t, "m").file
    second = torch.full((6,), 9.0)
    t.mean("m", second)
    assert arena(t, "m").file is not old_file
    assert held_array.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert t.compute(sync=False)["m"] == 9.0
    del held_array, record
    file = arena(t, "m").file
    t.mean("m", torch.ones(3))
    assert arena(t, "m").file is file  # nothing views it: the same file, written over
    assert t.compute(sync=False)["m"] == 1.0


def test_copies_that_stop_filling_their_arena_in_call_order_fold_one_by_one() -> None:
    """A step whose arena replaced its file midway (a view held), or whose copies
    change dtype, or that mixes python numbers, weighted and unweighted calls, reads
    each copy where it lies: numpy on the whole step."""
    from rlmetrics._engine.copies import as_array

    gen = torch.Generator().manual_seed(4)
    a, b = torch.randn(50, generator=gen), torch.randn(30, generator=gen)
    mask = torch.rand(50, generator=gen) > 0.5
    t = Tracker()
    t.mean("m", a, weight=mask)
    held_array = as_array(t._metric_records["m"].values[0])  # the next write needs a new file
    t.mean("m", b)
    t.mean("m", 2.5)
    t.mean("m", b.double())
    t.mean("m", a, weight=mask)
    x = np.concatenate([a.numpy(), b.numpy(), [2.5], b.numpy(), a.numpy()]).astype(np.float64)
    w = np.concatenate([mask.numpy(), np.ones(61), mask.numpy()])
    assert t.compute(sync=False)["m"] == pytest.approx((x * w).sum() / w.sum(), rel=1e-12)
    del held_array


def test_a_call_refused_by_its_size_writes_no_copy() -> None:
    """A call its kind refuses (here ``last`` takes one element) raises before any
    copy: the metric's next calls still fold from its arena, in order."""
    t = Tracker()
    t.last("x", torch.tensor([1.0]))
    with pytest.raises(ValueError, match="takes one value"):
        t.last("x", torch.tensor([5.0, 6.0]), weight=torch.tensor([True, True]))
    t.last("x", torch.tensor([2.0]), weight=torch.tensor([True]))
    assert arena(t, "x").calls == 2 and arena(t, "x", "weight").calls == 1
    assert t.compute(sync=False)["x"] == 2.0


def test_an_arena_recent_steps_used_little_of_is_given_back() -> None:
    """After ``ARENA_SHRINK_AFTER`` steps in a row that use under ``1 / ARENA_GROWTH``
    of its file, a metric's arena takes a new one; one step that needs more in between
    keeps it."""
    t = Tracker()
    huge, small = torch.zeros(100_000), torch.ones(1000)

    def step(value: torch.Tensor) -> None:
        t.sum("m", value)
        assert t.compute(sync=False)["m"] == float(value.sum())

    step(huge)
    big = arena(t, "m").file
    for _ in range(ARENA_SHRINK_AFTER - 1):
        step(small)
    step(huge)  # needed again: kept, the count starts over
    for _ in range(ARENA_SHRINK_AFTER - 1):
        step(small)
    assert arena(t, "m").file is big
    step(small)
    assert arena(t, "m").file is not big
    step(small)
    assert arena(t, "m").file.getbuffer().nbytes == 1000 * 4 < 100_000 * 4 // ARENA_GROWTH


def test_the_arenas_of_a_metric_no_longer_logged_are_given_back() -> None:
    """A name logged once with a large tensor, then not: after ``ARENA_SHRINK_AFTER``
    steps without it, its pooled records hold no arena; logged again, it gets a new
    one and reports numpy."""
    t = Tracker()
    t.mean("once", torch.ones(100_000), weight=torch.ones(100_000, dtype=torch.bool))
    t.mean("every", 1.0)
    t.compute(sync=False)
    for step in range(ARENA_SHRINK_AFTER):
        assert t._pool["once"].value_copies is not None, step
        t.mean("every", 1.0)
        t.compute(sync=False)
    records = t._pool["once"]
    assert records.value_copies is None and records.weight_copies is None
    t.mean("once", torch.arange(4.0), weight=torch.tensor([True, False, True, True]))
    assert t.compute(sync=False)["once"] == pytest.approx(5 / 3)


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
