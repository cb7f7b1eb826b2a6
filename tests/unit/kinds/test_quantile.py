"""The quantile sketch kind: its stated error against numpy on skewed data, a state size
independent of n, merge invariance over random partitions, a gloo sync, the non-finite
policies and its configuration errors."""

from __future__ import annotations

import dataclasses
import math
import pickle
import random
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmetrics import Tracker, TrackerState, register_kind, unregister_kind
from rlmetrics.kinds.dist import quantile_suffix
from rlmetrics.kinds.quantile import (
    NUM_MOMENTS,
    QuantileSketch,
    bucket_bounds,
    bucket_slots,
    bucket_values,
)

from gloo_ranks import count_collectives, ok_results, run_ranks

QS = (0.0, 0.001, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 0.999, 1.0)
SKETCH = QuantileSketch(name="test_sketch", quantiles=QS)
# a coarse sketch over a narrow range: under- and overflow are easy to reach
COARSE = QuantileSketch(
    name="test_sketch_coarse", alpha=0.05, min_positive=1e-3, max_value=1e3, quantiles=QS
)


@pytest.fixture(scope="module", autouse=True)
def kinds() -> Iterator[None]:
    register_kind(SKETCH, exist_ok=True)
    register_kind(COARSE, exist_ok=True)
    yield
    unregister_kind(SKETCH.name)
    unregister_kind(COARSE.name)


def datasets() -> dict[str, Callable[[np.random.Generator], np.ndarray]]:
    """Skewed data sets (value generators), all inside the default range but the tails."""
    n = 20_000
    return {
        "lognormal": lambda r: r.lognormal(0.0, 2.5, n),
        "pareto": lambda r: r.pareto(1.1, n) + 1.0,
        "cauchy": lambda r: r.standard_cauchy(n),
        "many_zeros": lambda r: np.where(r.random(n) < 0.7, 0.0, r.exponential(2.0, n)),
        "negatives": lambda r: -r.lognormal(1.0, 1.5, n),
        "mixed_signs": lambda r: r.normal(0.5, 3.0, n) * r.lognormal(0.0, 1.0, n),
        "tiny": lambda r: r.lognormal(0.0, 1.0, n) * 1e-7,
        "huge": lambda r: -r.lognormal(0.0, 1.0, n) * 1e7,
        "lengths": lambda r: r.geometric(0.002, n).astype(np.float64),
        "constant": lambda r: np.full(n, 3.7),
        "constant_negative": lambda r: np.full(n, -1e-5),
        "small_n": lambda r: r.lognormal(0.0, 1.0, 7),
    }


def assert_within_guarantee(
    kind: QuantileSketch, got: float, true: float, extremes: tuple[float, float], what: str
) -> None:
    """The module's stated guarantee for one estimate of the rank-exact ``true``, in a
    batch whose (min, max) are ``extremes``."""
    magnitude = abs(true)
    if true == 0.0 or math.isinf(true):
        assert got == true, what
    elif magnitude < kind.min_positive:  # underflow: absolute error below min_positive / 2
        assert abs(got - true) <= kind.min_positive / 2, what
    elif magnitude > kind.bounds[-1]:  # overflow: the observed max (min for negatives)
        assert got == (extremes[1] if true > 0 else extremes[0]), what
    else:
        bound = kind.relative_error * magnitude * (1 + 1e-12)
        assert abs(got - true) <= bound, f"{what}: {got!r} vs {true!r}, rel {abs(got / true - 1)}"


def check_against_numpy(
    kind: QuantileSketch, out: dict[str, float], x: np.ndarray, *, std: bool = True
) -> None:
    """Every key against numpy on the whole batch ``x`` (the selected elements); std
    unless ``std`` is False (x² overflows beyond about 1e154)."""
    expected = np.quantile(x, QS, method="lower")
    extremes = (x.min(), x.max())
    assert out.keys() == {f"x/{s}" for s in kind.result_names()}
    for q, true in zip(QS, expected.tolist(), strict=True):
        assert_within_guarantee(kind, out[f"x/{quantile_suffix(q)}"], true, extremes, f"q={q}")
    assert out["x/min"] == x.min() and out["x/max"] == x.max()
    assert out["x/p0"] == x.min() and out["x/p100"] == x.max()
    assert out["x/mean"] == pytest.approx(x.mean(), rel=1e-12, abs=1e-300)
    # std from (n, Σx, Σx²): cancellation costs about 1e-16 * (mean / std)**2
    if std:
        assert out["x/std"] == pytest.approx(x.std(), rel=1e-9, abs=1e-300)


@pytest.mark.usefixtures("log_path")
@pytest.mark.parametrize("name", list(datasets()))
def test_quantiles_within_the_stated_error_of_numpy(name: str) -> None:
    x = datasets()[name](np.random.default_rng(zlib.crc32(name.encode())))  # per set, fixed
    tracker = Tracker()
    for chunk in np.array_split(x, 3):  # a few micro-batches, as a CPU tensor
        tracker.log("x", torch.from_numpy(chunk), kind=SKETCH.name)
    out = tracker.compute()
    check_against_numpy(SKETCH, out, x)
    if name.startswith("constant"):  # clamped to [min, max]: exact
        assert {out[f"x/{quantile_suffix(q)}"] for q in QS} == {x[0]}


@pytest.mark.usefixtures("log_path")
def test_weights_select_elements_as_dist_does() -> None:
    rng = np.random.default_rng(3)
    x = rng.lognormal(0.0, 2.0, 5000) * rng.choice([-1.0, 1.0], 5000)
    w = rng.integers(0, 3, 5000).astype(np.float64)  # 0 drops an element, 1 and 2 keep it
    x[np.flatnonzero(w == 0)[:10]] = math.nan  # a deselected NaN changes nothing
    tracker = Tracker()
    tracker.log("x", torch.from_numpy(x), weight=torch.from_numpy(w), kind=SKETCH.name)
    check_against_numpy(SKETCH, tracker.compute(), x[w > 0])


@pytest.mark.usefixtures("log_path")
def test_out_of_range_values_follow_the_stated_clamping() -> None:
    rng = np.random.default_rng(4)
    x = np.concatenate(
        [rng.lognormal(0.0, 6.0, 3000), -rng.lognormal(0.0, 6.0, 3000), [1e-300, -1e300]]
    )
    tracker = Tracker()
    tracker.log("x", torch.from_numpy(x), kind=COARSE.name)
    out = tracker.compute()
    assert (np.abs(x) < 1e-3).sum() > 100 and (np.abs(x) > 1e3).sum() > 100  # both reached
    check_against_numpy(COARSE, out, x, std=False)


def test_numpy_and_torch_put_values_in_the_same_slots() -> None:
    bounds = SKETCH.bounds
    edges = np.concatenate([bounds, np.nextafter(bounds, 0), np.nextafter(bounds, np.inf)])
    values = np.concatenate(
        [edges, -edges, [0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, 1e300]]
    )
    slots = bucket_slots(torch.from_numpy(values), torch.from_numpy(bounds)).tolist()
    assert slots == bucket_slots(values, bounds).tolist()
    # upper-inclusive buckets: b[j] is in bucket j, its next float up in bucket j + 1
    zero_slot = bounds.size + 1
    assert slots[: bounds.size] == list(range(zero_slot + 1, zero_slot + 1 + bounds.size))
    assert slots[-3:] == [2 * zero_slot + 1, zero_slot + 1, 2 * zero_slot]  # NaN, under, over


def test_numbers_host_arrays_and_the_device_path_give_the_same_counts() -> None:
    rng = np.random.default_rng(8)
    bounds = SKETCH.bounds
    x = np.concatenate([bounds, -np.nextafter(bounds, np.inf), rng.standard_cauchy(500)])
    x = np.concatenate([x, [0.0, math.nan, math.inf, -math.inf]])
    w = rng.integers(0, 3, x.size).astype(np.float64)
    for weights in (None, w):
        states = []
        for route in ("numbers", "host", "device"):
            t = Tracker()
            t.reduce_host_data_with_numpy = route != "device"
            if route == "numbers":
                for i, value in enumerate(x.tolist()):
                    t.log(
                        "x", value, None if weights is None else float(weights[i]), kind=SKETCH.name
                    )
            else:
                tw = None if weights is None else torch.from_numpy(weights)
                t.log("x", torch.from_numpy(x), tw, kind=SKETCH.name)
            states.append(t.state().metrics["x"])
        for state in states[1:]:
            assert counts(state.sums) == counts(states[0].sums)
            np.testing.assert_array_equal(state.maxes, states[0].maxes)


def test_each_representative_is_within_alpha_of_its_bucket() -> None:
    for alpha in (0.001, 0.01, 0.2):
        bounds = bucket_bounds(alpha, 1e-6, 1e6)
        assert bounds[1] == 1e-6 and bounds[-1] >= 1e6 > bounds[-2]
        reps = bucket_values(bounds)[bounds.size + 3 : -1]  # the positive inner buckets
        low, high = bounds[:-1], bounds[1:]
        assert (low < reps).all() and (reps < high).all()
        worst = max(np.max(reps / low - 1), np.max(1 - reps / high))
        assert worst <= alpha * (1 + 1e-12)


def test_numbers_and_tensors_give_bit_identical_counts() -> None:
    x = np.random.default_rng(5).standard_cauchy(300)
    by_number, by_tensor = Tracker(), Tracker()
    for v in x.tolist():
        by_number.log("x", v, kind=SKETCH.name)
    by_tensor.log("x", torch.from_numpy(x), kind=SKETCH.name)
    a, b = by_number.state().metrics["x"], by_tensor.state().metrics["x"]
    assert a.maxes == b.maxes and counts(a.sums) == counts(b.sums)


def counts(sums: tuple[float, ...]) -> tuple[float, ...]:
    """A state's count slots: num, then the buckets and NaN count (not Σx, Σx²)."""
    return (sums[0], *sums[NUM_MOMENTS:])


# -- state size ---------------------------------------------------------------------------
def test_state_size_does_not_depend_on_n() -> None:
    sizes = set()
    for n in (10, 10**6):
        tracker = Tracker()
        tracker.log("x", torch.randn(n, dtype=torch.float64), kind=SKETCH.name)
        state = tracker.state().metrics["x"]
        sizes.add((len(state.sums), len(state.maxes), state.extra))
    assert sizes == {(SKETCH.num_sums, 2, None)}
    assert SKETCH.num_sums == NUM_MOMENTS + 2 * SKETCH.bounds.size + 4
    assert not SKETCH.has_extra  # nothing is gathered beyond the packed buffers


def test_state_dict_and_pickle_round_trips() -> None:
    tracker = Tracker()
    tracker.log(
        "x", torch.from_numpy(np.random.default_rng(9).lognormal(0, 2, 500)), kind=SKETCH.name
    )
    tracker.log("x", -3.0, kind=SKETCH.name)
    expected = tracker.state()
    restored = Tracker()
    restored.load_state_dict(tracker.state_dict())
    assert restored.state() == expected == pickle.loads(pickle.dumps(expected))
    assert restored.compute() == tracker.compute()


# -- merge invariance ---------------------------------------------------------------------
magnitudes = st.sampled_from([0.0, 1e-12, 1e-4, 1.0, 37.0, 1e8, 1e12])
elements = st.builds(
    lambda m, f, s: s * m * f, magnitudes, st.floats(0.5, 2.0), st.sampled_from([-1.0, 1.0])
)


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(elements, min_size=1, max_size=60),
    num_parts=st.integers(1, 5),
    seed=st.integers(0, 2**31),
)
def test_merge_is_invariant_to_the_partition(values: list, num_parts: int, seed: int) -> None:
    x = np.array(values)
    rng = random.Random(seed)
    whole = Tracker()
    whole.log("x", torch.from_numpy(x), kind=SKETCH.name)
    order = list(range(len(values)))
    rng.shuffle(order)
    cuts = sorted(rng.randint(0, len(values)) for _ in range(num_parts - 1))
    states = []
    for part in np.split(np.array(order, dtype=np.int64), cuts):
        tracker = Tracker()
        for i in part.tolist():  # numbers, arrays and tensors mixed
            tracker.log("x", x[i] if i % 2 else torch.from_numpy(x[i : i + 1]), kind=SKETCH.name)
        states.append(tracker.state())
    rng.shuffle(states)
    merged = TrackerState.merge_all(states)
    a, b = merged.metrics["x"], whole.state().metrics["x"]
    assert counts(a.sums) == counts(b.sums) and a.maxes == b.maxes
    got, expected = merged.compute(), whole.compute()
    scale = np.abs(x).max()  # sums of mixed signs cancel: the rounding is on this scale
    for key in expected:
        if key.endswith("/mean"):
            assert got[key] == pytest.approx(expected[key], rel=1e-9, abs=1e-12 * scale), key
        elif key.endswith("/std"):  # sqrt of a cancelled Σx²/n - mean²
            assert got[key] == pytest.approx(expected[key], rel=1e-9, abs=1e-7 * scale), key
        else:
            assert got[key] == expected[key], key


# -- a real 2-rank sync -------------------------------------------------------------------
def shard(rank: int) -> np.ndarray:
    rng = np.random.default_rng(11)
    x = np.concatenate([rng.lognormal(0.0, 3.0, 3000), -rng.pareto(1.2, 1000), np.zeros(500)])
    return np.array_split(rng.permutation(x), 2)[rank]


def rank_tracker(rank: int) -> Tracker:
    register_kind(SKETCH, exist_ok=True)  # every process registers the kind
    tracker = Tracker()
    x = shard(rank)
    for chunk in np.array_split(x, 3):
        tracker.log("x", torch.from_numpy(chunk), kind=SKETCH.name)
    tracker.log("x", float(x[0]), kind=SKETCH.name)  # a python number too
    return tracker


def gloo_steps(rank: int, world_size: int) -> list[tuple[dict[str, float], int, int]]:
    """Per step, on the gather path then on the all-reduce pair: (the sketch's results,
    collectives with the sketch and a mean, collectives with the mean alone)."""
    from rlmetrics._engine import sync as rd

    counts = count_collectives()
    out = []
    for limit in (rd.GATHER_LIMIT, 0):
        rd.GATHER_LIMIT = limit
        for _ in range(2):  # the first step agrees on the schema; the second is steady
            tracker = rank_tracker(rank)
            tracker.mean("m", float(rank))
            before = counts["n"]
            result = tracker.compute(timeout=60)
            with_sketch = counts["n"] - before
            alone = Tracker()
            alone.mean("m", float(rank))
            before = counts["n"]
            alone.compute(timeout=60)
            result.pop("m")
            out.append((result, with_sketch, counts["n"] - before))
    return out


@pytest.mark.slow  # spawns gloo ranks
def test_two_gloo_ranks_equal_one_process_with_no_collective_of_its_own() -> None:
    rank0, rank1 = ok_results(run_ranks(gloo_steps, 2, timeout=300))
    driver = TrackerState.merge_all([rank_tracker(r).state() for r in range(2)]).compute()
    whole = Tracker()
    x = np.concatenate([shard(0), [shard(0)[0]], shard(1), [shard(1)[0]]])
    whole.log("x", torch.from_numpy(x), kind=SKETCH.name)
    one = whole.compute()
    check_against_numpy(SKETCH, one, x)
    for step, ((got0, count0, alone0), (got1, _, _)) in enumerate(zip(rank0, rank1, strict=True)):
        assert got0 == got1, step
        if step < 2:  # the gather path merges the states as the driver does: same bits
            assert got0 == driver, step
        for key, value in one.items():
            if key.endswith(("/mean", "/std")):
                assert got0[key] == pytest.approx(value, rel=1e-12), (step, key)
            else:
                assert got0[key] == value, (step, key)
        if step % 2:  # steady: the sketch adds no collective (1 gather, or 2 all-reduces)
            assert count0 == alone0 == (1 if step < 2 else 2), step


# -- non-finite values ----------------------------------------------------------------------
def with_nonfinite(bad: float) -> np.ndarray:
    x = np.random.default_rng(6).lognormal(0.0, 2.0, 1000)
    x[[3, 500]] = bad
    return x


@pytest.mark.usefixtures("log_path")
def test_propagate_nan_makes_every_result_nan_as_dist() -> None:
    tracker = Tracker()
    tracker.log("x", torch.from_numpy(with_nonfinite(math.nan)), kind=SKETCH.name)
    tracker.dist("d", torch.from_numpy(with_nonfinite(math.nan)))
    assert tracker.state().metrics["x"].sums[-1] == 2  # the NaN count
    out = tracker.compute()
    assert all(math.isnan(out[f"x/{s}"]) for s in SKETCH.result_names())
    assert all(math.isnan(out[f"d/{s}"]) for s in ("mean", "std", "min", "max", "p50"))


@pytest.mark.usefixtures("log_path")
def test_propagate_inf_lands_in_the_overflow_bucket() -> None:
    x = with_nonfinite(math.inf)
    x[7] = -math.inf
    tracker = Tracker()
    tracker.log("x", torch.from_numpy(x), kind=SKETCH.name)
    out = tracker.compute()
    assert out["x/max"] == out["x/p100"] == math.inf and out["x/p0"] == -math.inf
    assert math.isnan(out["x/mean"])  # inf - inf, as numpy gives
    for q, true in zip(QS, np.quantile(x, QS, method="lower").tolist(), strict=True):
        got = out[f"x/{quantile_suffix(q)}"]
        assert_within_guarantee(SKETCH, got, true, (x.min(), x.max()), f"q={q}")


@pytest.mark.usefixtures("log_path")
def test_skip_drops_nonfinite_elements_and_counts_them() -> None:
    x = with_nonfinite(math.nan)
    x[9] = -math.inf
    tracker = Tracker(nonfinite="skip")
    tracker.log("x", torch.from_numpy(x), kind=SKETCH.name)
    out = tracker.compute()
    assert out.pop("x/nonfinite_count") == 3
    check_against_numpy(SKETCH, out, x[np.isfinite(x)])


@pytest.mark.usefixtures("log_path")
def test_error_rejects_the_call() -> None:
    tracker = Tracker(nonfinite="error")
    tracker.log("x", torch.from_numpy(with_nonfinite(math.inf)), kind=SKETCH.name)
    tracker.log("y", torch.tensor([1.0, 2.0]), kind=SKETCH.name)
    with pytest.raises(ValueError, match="'x'"):
        tracker.compute()
    assert tracker.compute()["y/max"] == 2.0  # every other call's metrics
    with pytest.raises(ValueError, match="non-finite value nan"):
        tracker.log("x", math.nan, kind=SKETCH.name)


# -- configuration ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"alpha": 0.0}, ValueError, r"alpha must lie in \(0, 1\), got 0.0"),
        ({"alpha": 1.0}, ValueError, r"alpha must lie in \(0, 1\)"),
        ({"alpha": math.nan}, ValueError, r"alpha must lie in \(0, 1\), got nan"),
        ({"alpha": "0.01"}, TypeError, "alpha must be a real number, got '0.01'"),
        ({"alpha": True}, TypeError, "alpha must be a real number"),
        ({"min_positive": 0.0}, ValueError, "min_positive must be a normal float > 0, got 0.0"),
        ({"min_positive": -1.0}, ValueError, "min_positive must be"),
        ({"min_positive": math.inf}, ValueError, "min_positive must be"),
        ({"max_value": 1e-9}, ValueError, r"max_value must lie in \(min_positive=1e-09, 1e300\]"),
        ({"max_value": math.inf}, ValueError, "max_value must lie in"),
        ({"max_value": math.nan}, ValueError, "max_value must lie in"),
        ({"alpha": 1e-6}, ValueError, "needs 41446[0-9]+ slots, more than 200000; raise alpha"),
        ({"quantiles": (0.5, 1.5)}, ValueError, r"quantiles must lie in \[0, 1\], got 1.5"),
    ],
)
def test_bad_configuration_raises_naming_the_argument(
    kwargs: dict, error: type, match: str
) -> None:
    with pytest.raises(error, match=match) as info:
        QuantileSketch(name="bad_sketch", **kwargs)
    assert "QuantileSketch 'bad_sketch'" in str(info.value)


def test_states_of_two_configurations_do_not_merge() -> None:
    a, b = Tracker(), Tracker()
    a.log("x", 1.0, kind=SKETCH.name)
    b.log("x", 1.0, kind=COARSE.name)
    with pytest.raises(
        ValueError, match="kind 'test_sketch' in one state and 'test_sketch_coarse'"
    ):
        TrackerState.merge_all([a.state(), b.state()])
    same_size = QuantileSketch(name=SKETCH.name, max_value=1.0001e9)  # other bounds
    assert same_size.num_sums == SKETCH.num_sums
    mine = a.state().metrics["x"]
    assert mine.fingerprint == SKETCH.fingerprint()
    theirs = dataclasses.replace(mine, fingerprint=same_size.fingerprint())
    with pytest.raises(ValueError, match="different configurations"):
        mine.merge(theirs, SKETCH)


def test_empty_metric_is_omitted_or_nan() -> None:
    tracker = Tracker(empty="nan")
    tracker.log("x", torch.zeros(0), kind=SKETCH.name)
    tracker.log("y", torch.tensor([1.0]), weight=torch.tensor([0.0]), kind=SKETCH.name)
    out = tracker.compute()
    assert set(out) == {f"{m}/{s}" for m in "xy" for s in SKETCH.result_names()}
    assert all(math.isnan(v) for v in out.values())


def test_the_docs_example_runs() -> None:
    text = (Path(__file__).parents[3] / "docs" / "quantiles.md").read_text()
    example = text.split("```python\n", 1)[1].split("```", 1)[0]
    try:
        exec(compile(example, "docs/quantiles.md", "exec"), {})
    finally:
        unregister_kind("quantile_len")
