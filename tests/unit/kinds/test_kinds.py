"""Conformance harness run over every built-in kind: numpy, merges, round trips."""

from __future__ import annotations

import json
import math
import pickle
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlmetrics import Tracker, TrackerState
from rlmetrics.kinds import BUILTIN_KINDS

from helpers import (
    assert_results,
    log_piece,
    merge_trackers,
    reference,
    scale_of,
    split,
    value_reps,
)

pytestmark = pytest.mark.usefixtures("log_path")  # host and tensor paths
# every exact kind; the quantile sketch is approximate by design and is checked against
# its stated error in test_quantile.py
KINDS = [cls.name for cls in BUILTIN_KINDS if cls.name != "quantile"]
WEIGHTED = {"mean", "std", "sum"}  # real weights; the other kinds select weight > 0
NAME = "m"

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

floats = st.floats(-1e6, 1e6, allow_nan=False, allow_subnormal=False)
grid = st.integers(-127, 127).map(lambda k: k / 4)  # exact in float16 and bfloat16
nonfinite = st.sampled_from([math.nan, math.inf, -math.inf])


@st.composite
def batches(draw: st.DrawFn, kind: str, skip: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """A whole batch: values (with non-finite ones when ``skip``) and weights or a mask."""
    n = draw(st.integers(0, 30))
    element = draw(st.sampled_from([floats, grid]))
    if skip:
        element = st.one_of(element, element, element, nonfinite)
    x = np.array(draw(st.lists(element, min_size=n, max_size=n)), dtype=np.float64)
    mode = draw(
        st.sampled_from(["none", "mask", "weight"] if kind in WEIGHTED else ["none", "mask"])
    )
    if mode == "none":
        return x, None
    if mode == "mask":
        mask = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=np.float64)
        return poison_masked(draw, x, mask), mask
    weight = st.one_of(st.just(0.0), st.floats(1e-3, 10.0), st.integers(1, 5).map(float))
    w = np.array(draw(st.lists(weight, min_size=n, max_size=n)), dtype=np.float64)
    return poison_masked(draw, x, w), w


def poison_masked(draw: st.DrawFn, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x`` with NaN or ±inf at some weight-0 positions (padding often holds them): they
    must change nothing, under every policy."""
    bad = draw(st.lists(nonfinite, min_size=x.size, max_size=x.size))
    chosen = draw(st.lists(st.booleans(), min_size=x.size, max_size=x.size))
    poison = (w == 0) & np.array(chosen, dtype=bool)
    return np.where(poison, np.array(bad, dtype=np.float64).reshape(x.shape), x)


def log_whole(tracker: Tracker, kind: str, x: np.ndarray, w: np.ndarray | None) -> None:
    """Log the whole batch in one call, as a float64 tensor (last: its one value)."""
    if kind == "last":
        x = x[-1:]
        if not x.size:
            return
    value = torch.from_numpy(x.copy())
    if w is None:
        tracker.log(NAME, value, kind=kind)
    else:
        tracker.log(NAME, value, torch.from_numpy(w.copy()), kind=kind)


def expected_results(kind: str, x: np.ndarray, w: np.ndarray | None, skip: bool) -> dict:
    """numpy's answer, plus the non-finite count under ``nonfinite="skip"``."""
    if not skip:
        return reference(kind, NAME, x, w)
    bad = ~np.isfinite(x) if w is None else ~np.isfinite(x) & (w > 0)  # weight 0: not counted
    out = reference(kind, NAME, x[~bad], None if w is None else w[~bad])
    if bad.any():
        out[f"{NAME}/nonfinite_count"] = float(bad.sum())
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("policy", ["propagate", "skip", "error"])
@PROPERTY
@given(data=st.data())
def test_pieces_merged_in_any_order_and_tree_equal_the_whole(
    kind: str, policy: str, data: st.DataObject
) -> None:
    """Random partitions, representations, trackers and merge trees give the whole's value
    (NaN and ±inf at weight-0 positions, under every policy, change nothing)."""
    skip = policy == "skip"
    if kind == "last":
        x, w = _last_batch(data), None
        skip = False
    else:
        x, w = data.draw(batches(kind, skip), label="batch")
    cuts = data.draw(st.lists(st.integers(0, x.size), max_size=6), label="cuts")
    num_trackers = data.draw(st.integers(1, 4), label="trackers")
    rnd = data.draw(st.randoms(use_true_random=False), label="rnd")
    expected = expected_results(kind, x, w, skip)
    scale = scale_of(kind, x, w)

    whole = Tracker(nonfinite=policy)
    log_whole(whole, kind, x, w)
    assert_results(whole.compute(reset=False), expected, kind, scale)

    trackers = [Tracker(nonfinite=policy) for _ in range(num_trackers)]
    for piece in split(x.size, cuts):
        px, pw = x[piece], None if w is None else w[piece]
        if kind == "last":
            if not px.size:
                continue
            px = px[-1:]  # every piece logs the same replicated value
        tracker = rnd.choice(trackers)
        rep = rnd.choice(value_reps(px))

        def log(value: object, weight: object = None, tracker: Tracker = tracker) -> None:
            tracker.log(NAME, value, weight, kind=kind)

        log_piece(log, px, pw, rep, rnd)
    merged = merge_trackers(trackers, rnd)
    assert_results(merged.compute(), whole.compute(), kind, scale)
    assert_results(Tracker().merge(merged).compute(), expected, kind, scale)


def _last_batch(data: st.DataObject) -> np.ndarray:
    """A replicated value repeated over a batch (or nothing logged at all)."""
    n = data.draw(st.integers(0, 6), label="n")
    value = data.draw(st.one_of(floats, grid), label="value")
    return np.full(n, value)


@pytest.mark.parametrize("kind", KINDS)
def test_matches_numpy_for_every_input_type(kind: str) -> None:
    """One batch logged through each representation (and with a 2-d shape) matches numpy."""
    rng = np.random.default_rng(0)
    x = rng.integers(-40, 40, size=12) / 4
    w = None if kind == "last" else rng.integers(0, 3, size=12).astype(np.float64)
    if w is not None and kind not in WEIGHTED:
        w = (w > 0).astype(np.float64)
    for rep in value_reps(x):
        t = Tracker()

        def log(value: object, weight: object = None, t: Tracker = t) -> None:
            t.log(NAME, value, weight, kind=kind)

        log_piece(log, x[-1:] if kind == "last" else x, w, rep, random.Random(1))
        assert_results(t.compute(), reference(kind, NAME, x, w), kind, scale_of(kind, x, w))


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "last"])
def test_merge_does_not_change_its_inputs(kind: str) -> None:
    """Merging states is pure: both inputs report what they did before."""
    a, b = Tracker(), Tracker()
    a.log(NAME, torch.tensor([1.0, 2.0, 4.0]), kind=kind)
    b.log(NAME, 8.0, kind=kind)
    sa, sb = a.state(), b.state()
    before = (sa.compute(), sb.compute())
    sa.merge(sb)
    Tracker().merge(sa).merge(sb)
    assert (sa.compute(), sb.compute()) == before
    assert (a.compute(), b.compute()) == before


# -- round trips ---------------------------------------------------------------------------------
def _filled(kind: str) -> Tracker:
    """A tracker whose metric has host and device parts (a python and a tensor call)."""
    t = Tracker()
    if kind == "last":
        t.last(NAME, torch.tensor(0.25, dtype=torch.float64))
        return t
    t.log(NAME, 3.5, kind=kind)
    t.log(NAME, torch.tensor([1.0, -2.0, 7.25]), torch.tensor([1.0, 0.0, 2.0]), kind=kind)
    return t


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_round_trip(kind: str) -> None:
    """state_dict -> JSON -> load_state_dict, then more logging: as if never saved."""
    original, restored = _filled(kind), Tracker()
    restored.mean("stale", 1.0)  # replaced by the load
    restored.load_state_dict(json.loads(json.dumps(original.state_dict())))
    assert "stale" not in restored
    for t in (original, restored):
        t.log(NAME, 0.5, kind=kind)
    assert restored.compute() == original.compute()


@pytest.mark.parametrize("kind", KINDS)
def test_pickle_round_trip(kind: str) -> None:
    """A pickled state computes and merges like the original."""
    state = _filled(kind).state()
    copy = pickle.loads(pickle.dumps(state))
    assert isinstance(copy, TrackerState)
    assert copy.compute() == state.compute()
    assert copy.merge(state).compute() == state.merge(state).compute()


def test_state_dict_rejects_unknown_versions() -> None:
    with pytest.raises(ValueError, match="unsupported TrackerState version 7"):
        Tracker().load_state_dict({"version": 7, "metrics": {}})


# -- std stays exact when the mean dwarfs the spread -------------------------------------------
@pytest.mark.parametrize("weighted", [False, True])
def test_std_with_large_mean_matches_numpy(weighted: bool) -> None:
    """mean 1e8, std 1e-3: numpy's two-pass std to 1e-9 whole, 1e-5 through merges.

    Where the textbook Σx² formula keeps no digit, a merge's error comes from the stored
    means alone: each is rounded to ulp(1e8) = 1.5e-8 = 1.5e-5 std, which enters
    δ² W_a W_b / W linearly; 30 pieces merged in random trees land at 1e-7 to 2e-6
    (measured over 20 trees).
    """
    rng = np.random.default_rng(42)
    x = rng.normal(1e8, 1e-3, size=2000)
    w = rng.integers(0, 4, size=x.size).astype(np.float64) if weighted else None
    expected = reference("std", NAME, x, w)[NAME]
    assert 5e-4 < expected < 2e-3

    def close(t: Tracker | TrackerState, rel: float = 1e-9) -> None:
        got = t.compute()[NAME]
        assert got == pytest.approx(expected, rel=rel, abs=0)

    whole = Tracker()
    whole.std(NAME, torch.from_numpy(x), None if w is None else torch.from_numpy(w))
    close(whole)
    as_numpy = Tracker()
    as_numpy.std(NAME, x, w)
    close(as_numpy)

    rnd = random.Random(3)
    trackers = [Tracker() for _ in range(5)]
    for piece in split(x.size, sorted(rnd.sample(range(x.size), 30))):
        tracker = rnd.choice(trackers)
        rep = rnd.choice(["py", "np64", "t64"])
        pw = None if w is None else w[piece]
        log_piece(lambda v, m=None, t=tracker: t.std(NAME, v, m), x[piece], pw, rep, rnd)
    close(merge_trackers(trackers, rnd), rel=1e-5)


def test_dist_std_with_large_mean_matches_numpy() -> None:
    rng = np.random.default_rng(7)
    x = rng.normal(1e8, 1e-3, size=500)
    a, b = Tracker(), Tracker()
    a.dist(NAME, torch.from_numpy(x[:200]))
    b.dist(NAME, x[200:])
    got = a.merge(b).compute()[f"{NAME}/std"]
    assert got == pytest.approx(np.std(x), rel=1e-6, abs=0)


@pytest.mark.filterwarnings("error")  # numpy's overflow in its squares
def test_dist_std_of_values_whose_squares_overflow_is_finite() -> None:
    """The spread of values near float64's largest is finite, as statistics' exact
    population deviation says, and no numpy overflow warning escapes."""
    import statistics

    x = [1e300, -1e300, 3e299, 0.0]
    tracker = Tracker()
    tracker.dist(NAME, x[:2])
    tracker.dist(NAME, torch.tensor(x[2:], dtype=torch.float64))
    got = tracker.compute()[f"{NAME}/std"]
    assert got == pytest.approx(statistics.pstdev(x), rel=1e-12)
