"""User-defined kinds: registration checks, the Histogram example against numpy, and
one merge result through the container, the Ray-style driver merge and a gloo group."""

from __future__ import annotations

import contextlib
import math
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from rlmetrics import (
    ExtraKind,
    Kind,
    MetricState,
    Tracker,
    TrackerState,
    register_kind,
    unregister_kind,
)
from rlmetrics.kinds import Batch, check_kind, get_kind
from rlmetrics.kinds.base import result_of
from rlmetrics.kinds.histogram import Histogram

from gloo_ranks import ok_results, run_ranks

pytestmark = pytest.mark.usefixtures("log_path")  # host and tensor paths
EDGES = (0.0, 0.5, 1.0, 2.0, 4.0)
HIST = Histogram(name="test_hist", edges=EDGES, quantiles=(0.0, 0.1, 0.5, 0.9, 1.0))


class Distinct(ExtraKind):
    """A kind that cannot be packed: the set of distinct values, synced by object gather."""

    name = "test_distinct"
    num_sums = 1

    def reduce(self, batch: Batch) -> tuple[Any, Any]:
        return batch.columns(batch.count()), batch.columns()

    def reduce_extra(self, batch: Batch) -> list[Any]:
        pieces = zip(batch.split(batch.values), batch.split(batch.selected()), strict=True)
        if batch.on_host:  # host extras: the sets themselves
            return [frozenset(values[kept].tolist()) for values, kept in pieces]
        return list(pieces)  # device: select on the host, at step end

    def empty_extra(self) -> frozenset:
        return frozenset()

    def host_extra(self, dev_extra: Any) -> frozenset:
        return frozenset(x for values, kept in dev_extra or [] for x in values[kept].tolist())

    def merge_extra(self, a: Any, b: Any) -> frozenset:
        return frozenset(a) | frozenset(b)

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        return {"": float(len(state.extra))} if state.sums[0] else None


class KeptValues(ExtraKind):
    """Keeps each row's pieces as ``batch.split`` hands them out (docs/custom-kinds.md:
    the operation for extras); reports the sum of the selected values."""

    name = "test_kept_values"

    def reduce(self, batch: Batch) -> tuple[Any, Any]:
        return batch.columns(), batch.columns()

    def reduce_extra(self, batch: Batch) -> list[Any]:
        pieces = zip(batch.split(batch.values), batch.split(batch.selected()), strict=True)
        return [tuple(pair) for pair in pieces] if batch.on_host else list(pieces)

    def empty_extra(self) -> tuple:
        return ()

    def host_extra(self, dev_extra: Any) -> tuple:
        return tuple(x.cpu().numpy() for pair in dev_extra or [] for x in pair)

    def merge_extra(self, a: Any, b: Any) -> tuple:
        return tuple(a) + tuple(b)

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        pairs = list(zip(state.extra[::2], state.extra[1::2], strict=True))
        return {"sum": float(sum(v[k].sum() for v, k in pairs))} if pairs else None


DISTINCT = Distinct()
KEPT = KeptValues()


@pytest.fixture(scope="module", autouse=True)
def kinds() -> Any:
    register_kind(HIST, exist_ok=True)
    register_kind(DISTINCT, exist_ok=True)
    register_kind(KEPT, exist_ok=True)
    yield
    unregister_kind(HIST.name)
    unregister_kind(DISTINCT.name)
    unregister_kind(KEPT.name)


# -- the Histogram kind against numpy ---------------------------------------------------
def numpy_histogram(x: np.ndarray, w: np.ndarray, quantiles: tuple[float, ...]) -> dict:
    """Fractions by np.histogram (under/over included) and quantiles by np.interp on the
    piecewise-linear CDF through (min, 0), (edge_i, count below edge_i), (max, total)."""
    x, w = x[w > 0], w[w > 0]
    outer = np.array([-np.inf, *EDGES, np.inf])
    counts, _ = np.histogram(x, bins=outer, weights=w)
    total = counts.sum()
    out = {"h/count": total, "h/under": counts[0] / total, "h/over": counts[-1] / total}
    out.update({f"h/bin_{i}": c / total for i, c in enumerate(counts[1:-1])})
    knots = np.array([x.min(), *EDGES, x.max()])
    cdf = np.concatenate(([0.0], np.cumsum(counts)))
    for q in quantiles:
        out[f"h/p{round(q * 100, 6):g}"] = np.interp(q * total, cdf, knots)
    return out


def test_histogram_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    x = rng.gamma(2.0, 0.8, 500) - 0.3  # every bin, under and over non-empty
    w = rng.integers(0, 3, 500).astype(np.float64)
    tracker = Tracker()
    tracker.log("h", torch.from_numpy(x), weight=torch.from_numpy(w), kind="test_hist")
    out = tracker.compute()
    expected = numpy_histogram(x, w, HIST.quantiles)
    assert out.keys() == expected.keys()
    for key, value in expected.items():
        assert out[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    assert out["h/p0"] == x[w > 0].min() and out["h/p100"] == x[w > 0].max()


def test_histogram_bins_are_half_open_and_numbers_match_tensors() -> None:
    values = [-1.0, 0.0, 0.5, 0.99, 2.0, 4.0, 7.0]  # edges fall into the bin they open
    by_number, by_tensor = Tracker(), Tracker()
    for v in values:
        by_number.log("h", v, kind="test_hist")
    by_tensor.log("h", torch.tensor(values), kind="test_hist")
    out = by_number.compute()
    assert out == by_tensor.compute()
    fractions = [out[k] * 7 for k in ("h/under", "h/bin_0", "h/bin_1", "h/bin_2", "h/bin_3")]
    assert fractions == [1, 1, 2, 0, 1] and out["h/over"] * 7 == 2


def test_histogram_weights_masks_and_empty() -> None:
    tracker = Tracker(empty="nan")
    tracker.log(
        "h", torch.tensor([100.0, 1.5, -50.0]), weight=torch.tensor([0, 1, 0]), kind=HIST.name
    )
    tracker.log("empty", torch.zeros(0), kind=HIST.name)
    out = tracker.compute()
    assert out["h/p0"] == out["h/p100"] == 1.5  # masked elements set no extreme
    assert out["h/count"] == 1.0 and out["h/bin_2"] == 1.0
    assert set(k for k in out if k.startswith("empty/")) == {
        f"empty/{s}" for s in HIST.result_names()
    }
    assert all(math.isnan(v) for k, v in out.items() if k.startswith("empty/"))


def test_histogram_is_partition_invariant() -> None:
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.normal(1.0, 1.5, 300))
    w = torch.from_numpy(rng.integers(0, 4, 300).astype(np.float64))
    whole = Tracker()
    whole.log("h", x, weight=w, kind=HIST.name)
    pieces = []
    for idx in np.array_split(rng.permutation(300), 5):
        part = Tracker()
        part.log("h", x[idx], weight=w[idx], kind=HIST.name)
        pieces.append(part.state())
    assert TrackerState.merge_all(pieces[::-1]).compute() == whole.compute()


NONFINITE_X = np.array([-0.5, np.nan, 3.0, np.inf, -np.inf, 1.5, np.nan, 7.0])
NONFINITE_W = np.array([1.0, 1.0, 2.0, 1.0, 3.0, 0.0, 0.0, 1.0])  # a masked NaN: no effect


def log_nonfinite(tracker: Tracker, as_numbers: bool) -> None:
    if as_numbers:  # the flat path of python numbers (masked ones are not logged)
        for x, w in zip(NONFINITE_X, NONFINITE_W, strict=True):
            if w > 0:
                tracker.log("h", float(x), float(w), kind=HIST.name)
    else:
        x, w = torch.from_numpy(NONFINITE_X), torch.from_numpy(NONFINITE_W)
        tracker.log("h", x[:4], weight=w[:4], kind=HIST.name)
        tracker.log("h", x[4:], weight=w[4:], kind=HIST.name)


@pytest.mark.parametrize("as_numbers", [False, True])
def test_histogram_nan_is_in_no_bin_and_infinities_are_under_and_over(as_numbers) -> None:
    """Under "propagate" a selected NaN makes every result NaN (it is in no bin), also
    after a merge with a NaN-free state; ±inf count as under and over."""
    tracker = Tracker()
    log_nonfinite(tracker, as_numbers)
    with_nan = tracker.state()
    out = with_nan.compute()
    assert out.keys() == {f"h/{s}" for s in HIST.result_names()}
    assert all(math.isnan(v) for v in out.values()), out
    finite = Tracker()
    finite.log("h", torch.tensor([0.75, 3.0]), kind=HIST.name)
    merged = TrackerState.merge_all([finite.state(), with_nan]).compute()
    assert all(math.isnan(v) for v in merged.values()), merged

    keep = ~np.isnan(NONFINITE_X)
    x, w = NONFINITE_X[keep], NONFINITE_W[keep]
    infinite = Tracker()
    for value, weight in zip(x, w, strict=True):
        infinite.log("h", float(value), float(weight), kind=HIST.name)
    infinite.log("h", torch.from_numpy(x), weight=torch.from_numpy(w), kind=HIST.name)
    out = infinite.compute()
    counts, _ = np.histogram(x, bins=[-np.inf, *EDGES, np.inf], weights=w)
    assert out["h/count"] == 2 * counts.sum() == 2 * 8
    assert out["h/under"] == counts[0] / 8 == 4 / 8  # -0.5 and -inf (weight 3)
    assert out["h/over"] == counts[-1] / 8 == 2 / 8  # 7.0 and inf
    assert out["h/p0"] == -np.inf and out["h/p100"] == np.inf  # the observed range, exactly


@pytest.mark.parametrize("as_numbers", [False, True])
def test_histogram_skips_or_rejects_non_finite_values_by_the_policy(as_numbers) -> None:
    skip = Tracker(nonfinite="skip")
    log_nonfinite(skip, as_numbers)
    out = skip.compute()
    finite = np.isfinite(NONFINITE_X) & (NONFINITE_W > 0)
    expected = numpy_histogram(NONFINITE_X[finite], NONFINITE_W[finite], HIST.quantiles)
    assert out.pop("h/nonfinite_count") == 3  # a NaN and two infinities with weight > 0
    assert out.keys() == expected.keys()
    for key, value in expected.items():
        assert out[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key

    error = Tracker(nonfinite="error")
    with pytest.raises(ValueError, match="'h'"):
        log_nonfinite(error, as_numbers)  # a python number raises at the call
        error.compute()  # a tensor call is rejected at the step's end


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"edges": [1.0]}, "at least 2 edges"),
        ({"edges": [0.0, 0.0, 1.0]}, "strictly increasing"),
        ({"edges": [0.0, math.inf]}, "finite"),
        ({"edges": [0.0, 1.0], "quantiles": (1.5,)}, r"quantiles must lie in \[0, 1\]"),
    ],
)
def test_histogram_rejects_bad_configuration(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Histogram(name="bad", **kwargs)


# -- registration ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, weighted",
    [(torch.float32, "mask"), (torch.float32, "none"), (torch.float64, "mask")],
    ids=["float32 masked", "float32", "float64 masked"],
)
def test_a_kind_keeping_split_pieces_keeps_its_values_after_later_folds(
    dtype: torch.dtype, weighted: str
) -> None:
    """A user kind that keeps ``batch.split(batch.values)`` pieces in its extras, as the
    docs present it, holds what was logged: a ``take_state()`` snapshot and ``dist``
    report numpy's sums after the next steps folded (float32 values and bool masks are
    joined into buffers the tracker reuses, so the pieces were views of them: c/sum
    reported 100.0 instead of 10.0)."""
    rng = np.random.default_rng(5)
    t = Tracker()
    snapshots, expected = [], []
    for _ in range(3):
        x = rng.normal(size=(3, 40)).astype(np.float32 if dtype == torch.float32 else np.float64)
        masks = rng.random((3, 40)) < 0.7 if weighted == "mask" else np.ones((3, 40), bool)
        for row, mask in zip(x, masks, strict=True):
            weight = torch.from_numpy(mask) if weighted == "mask" else None
            t.log("c", torch.from_numpy(row), weight, kind=KEPT.name)
            t.dist("d", torch.from_numpy(row), weight)
        kept = x.astype(np.float64)[masks]
        expected.append({"c/sum": float(kept.sum()), **reference_dist("d", kept)})
        snapshots.append(t.take_state())
    for snapshot, want in zip(snapshots, expected, strict=True):
        got = snapshot.compute()
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def reference_dist(name: str, x: np.ndarray) -> dict[str, float]:
    """A dist's results by numpy (its default quantiles)."""
    out = {f"{name}/{k}": float(f(x)) for k, f in (("mean", np.mean), ("std", np.std),
                                                    ("min", np.min), ("max", np.max))}  # fmt: skip
    for q, value in zip((0.5, 0.9, 0.99), np.quantile(x, (0.5, 0.9, 0.99)), strict=True):
        out[f"{name}/p{round(q * 100, 6):g}"] = float(value)
    return out


def test_registering_a_name_twice_raises() -> None:
    other = Histogram(name="test_hist", edges=(0.0, 1.0))
    with pytest.raises(ValueError, match="kind 'test_hist' is already registered as Histogram"):
        register_kind(other)
    with pytest.raises(ValueError, match="exist_ok=True accepts only an equal kind"):
        register_kind(other, exist_ok=True)
    with pytest.raises(ValueError, match="already registered"):
        register_kind(Histogram(name="test_hist", edges=EDGES, quantiles=HIST.quantiles))
    equal = Histogram(name="test_hist", edges=list(EDGES), quantiles=HIST.quantiles)
    assert register_kind(equal, exist_ok=True) is HIST
    with pytest.raises(ValueError, match=r"'mean' is already registered.*built-in names"):
        register_kind(Histogram(name="mean", edges=(0.0, 1.0)))
    with pytest.raises(ValueError, match="built in and cannot be unregistered"):
        unregister_kind("mean")


def test_unregister_then_register_again() -> None:
    kind = register_kind(Histogram(name="test_hist_tmp", edges=(0.0, 1.0)))
    unregister_kind("test_hist_tmp")
    with pytest.raises(ValueError, match="unknown kind 'test_hist_tmp'"):
        get_kind("test_hist_tmp")
    assert register_kind(kind) is kind
    unregister_kind("test_hist_tmp")


class Malformed(Kind):
    name = "test_malformed"
    num_sums = 2

    def reduce(self, batch: Batch) -> tuple[Any, Any]:
        return batch.columns(batch.sum_by(batch.values)), batch.columns()  # one slot, not two

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        return {"": state.sums[0]}


def make(base: type[Kind], **attrs: Any) -> Kind:
    return type("Custom", (base,), attrs)()


@pytest.mark.parametrize(
    ("kind", "error", "match"),
    [
        ("not a kind", TypeError, "expects a Kind instance, got str"),
        (make(Malformed, name=""), ValueError, "name must be a non-empty string"),
        (make(Malformed, num_sums=-1), ValueError, "num_sums must be an int >= 0, got -1"),
        (make(Malformed, num_maxes=True), ValueError, "num_maxes must be an int >= 0, got True"),
        (make(Malformed, has_extra=1), ValueError, "has_extra must be a bool, got 1"),
        (make(Kind, name="test_empty"), ValueError, r"must implement reduce\(\), result\(\)"),
        (
            make(Malformed, has_extra=True),
            ValueError,
            r"has_extra=True takes the extra methods of rlmetrics.kinds.ExtraKind",
        ),
        (
            make(
                ExtraKind, name="test_malformed", reduce=Malformed.reduce, result=Malformed.result
            ),
            ValueError,
            r"must implement reduce_extra\(\), merge_extra\(\) \(has_extra",
        ),
        (
            make(Malformed),
            ValueError,
            r"'test_malformed' \(Custom\): reduce\(\) returned sums of shape \(3, 1\).*"
            r"expected shape \(3, 2\) float64, as num_sums=2 declares",
        ),
        (
            make(Malformed, reduce=lambda self, b: (b.columns(b.count(), b.count())[:, :2] * 1, 1)),
            ValueError,
            r"must return a \(sums, maxes\) pair of ndarrays on the host",
        ),
        (
            make(
                Malformed,
                reduce=lambda self, b: (b.columns(b.count(), b.count()) * 1j, b.columns()),
            ),
            ValueError,
            "dtype complex128",
        ),
        (
            make(Malformed, reduce=lambda self, b: (b.values[7], b.columns())),
            ValueError,
            r"reduce\(\) failed on a probe batch on the host: index 7",
        ),
    ],
)
def test_malformed_kinds_are_refused(kind: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        register_kind(kind)
    assert get_kind("mean").name == "mean"  # nothing half-registered


def test_check_kind_accepts_every_builtin_and_the_examples() -> None:
    for name in ("mean", "sum", "max", "min", "std", "last", "dist"):
        check_kind(get_kind(name))
    check_kind(HIST)
    check_kind(DISTINCT)


# -- one result through three merge paths ---------------------------------------------
def shard_data(rank: int) -> tuple[Tensor, Tensor]:
    """Rank ``rank``'s values and integer weights (a fixed split of one batch)."""
    rng = np.random.default_rng(7)
    x = np.round(rng.normal(1.0, 1.5, 200), 1)  # repeated values for the Distinct kind
    w = rng.integers(0, 3, 200).astype(np.float64)
    idx = np.array_split(np.arange(200), 2)[rank]
    return torch.from_numpy(x[idx]), torch.from_numpy(w[idx])


def rank_tracker(rank: int) -> Tracker:
    register_kind(HIST, exist_ok=True)  # every process registers the same kinds
    register_kind(DISTINCT, exist_ok=True)
    x, w = shard_data(rank)
    tracker = Tracker()
    for chunk in range(3):  # a few micro-batches
        sl = slice(chunk * 40, (chunk + 1) * 40)
        tracker.log("lat", x[sl], weight=w[sl], kind=HIST.name)
        tracker.log("uniq", x[sl], weight=w[sl], kind=DISTINCT.name)
        tracker.mean("m", x[sl], weight=w[sl])
    return tracker


def gloo_compute(rank: int, world_size: int) -> dict[str, float]:
    return rank_tracker(rank).compute()


@pytest.mark.slow  # spawns gloo ranks
def test_custom_kinds_merge_identically_through_container_ray_and_gloo(log_path: str) -> None:
    if log_path != "host":  # bit-identical needs one path, and spawned ranks take the default
        pytest.skip("spawned ranks log through the default (host) path")
    tensordict = pytest.importorskip("tensordict", reason="the container path needs tensordict")
    from rlmetrics.integrations.tensordict import attach_metrics, collect, get_metrics

    outputs = [
        attach_metrics(tensordict.TensorDict({"x": shard_data(r)[0]}, [100]), rank_tracker(r))
        for r in range(2)
    ]
    container = get_metrics(collect(outputs)).compute()
    # the Ray path: worker states pickled to a driver and merged there
    states = [pickle.loads(pickle.dumps(rank_tracker(r).state())) for r in range(2)]
    driver = TrackerState.merge_all(states).compute()
    gloo = ok_results(run_ranks(gloo_compute, 2))
    assert gloo[0] == gloo[1] == driver == container
    assert {"lat/p50", "lat/bin_3", "uniq", "m"} <= container.keys()
    x = torch.cat([shard_data(r)[0] for r in range(2)])
    w = torch.cat([shard_data(r)[1] for r in range(2)])
    assert container["uniq"] == len(set(x[w > 0].tolist()))
    expected = numpy_histogram(x.numpy(), w.numpy(), HIST.quantiles)
    for key, value in expected.items():
        assert container[key.replace("h/", "lat/")] == pytest.approx(value, rel=1e-12, abs=1e-12)


def differently_configured(rank: int, world_size: int) -> str:
    """Both ranks name a histogram 'h_cfg', with other edges on rank 1."""
    edges = (0.0, 1.0, 2.0) if rank == 0 else (0.0, 1.0, 3.0)
    register_kind(Histogram(name="h_cfg", edges=edges))
    tracker = Tracker()
    tracker.log("lat", 0.5, kind="h_cfg")
    try:
        tracker.compute(timeout=30)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.slow  # spawns gloo ranks
def test_one_kind_configured_two_ways_across_ranks_raises_on_every_rank() -> None:
    for message in ok_results(run_ranks(differently_configured, 2)):
        assert "'lat'" in message and "configured as" in message and "rank 1" in message


def test_merging_states_of_differently_sized_kinds_raises() -> None:
    small = MetricState("h", (1.0, 2.0), ())
    large = MetricState("h", (1.0, 2.0, 3.0), ())
    with pytest.raises(ValueError, match="different slot counts"):
        small.merge(large, HIST)


class RowsMean(Kind):
    """A weighted mean whose result is stated once, vectorised (``result_columns``)."""

    name = "test_rows_mean"
    num_sums = 2

    def reduce(self, batch: Batch) -> tuple[Any, Any]:
        weights = batch.weights
        return batch.columns(batch.sum_by(batch.values * weights), batch.sum_by(weights)), (
            batch.columns()
        )

    def result_columns(self, sums: np.ndarray, maxes: np.ndarray, *_: Any) -> tuple:
        present = sums[:, 1] != 0
        return {"": sums[:, 0] / np.where(present, sums[:, 1], 1.0)}, present


class OneByOneMean(RowsMean):
    """The same mean stated per metric (``result``): the framework's default
    ``result_columns`` calls it for each metric."""

    name = "test_one_by_one_mean"
    result_columns = Kind.result_columns

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        total, weight = state.sums
        return None if weight == 0 else {"": total / weight}


def test_a_result_stated_either_way_reports_the_same() -> None:
    """A kind states its result once, vectorised or per metric; both report the same
    values (among built-in kinds), and ``result_of`` reads one metric of either. The
    default runs one way only: ``result_columns`` calls ``result``, never the reverse."""
    kinds = [register_kind(RowsMean()), register_kind(OneByOneMean())]
    try:
        t = Tracker()
        for kind in kinds:
            for i in range(12):
                t.log(f"{kind.name}/{i:02d}", [float(i), 2.0], weight=[1.0, float(i % 3)],
                      kind=kind.name)  # fmt: skip
            t.log(f"{kind.name}/empty", [1.0], weight=[0.0], kind=kind.name)
        t.mean("a_mean", 3.0)
        t.std("z_std", [1.0, 3.0])
        state = t.state()
        expected = state.compute()
        got = t.compute()
        assert got == expected and got["test_rows_mean/00"] == 0.0
        for i in range(12):
            one, rows = (got[f"{kind.name}/{i:02d}"] for kind in kinds)
            assert one == rows == (i + 2.0 * (i % 3)) / (1 + i % 3)
        for kind in kinds:
            assert f"{kind.name}/empty" not in got
            metric = state.metrics[f"{kind.name}/05"]
            assert result_of(kind, metric) == {"": got[f"{kind.name}/05"]}
        with pytest.raises(NotImplementedError, match="neither result nor result_columns"):
            kinds[0].result(state.metrics[f"{kinds[0].name}/05"])
        assert list(got) == sorted(got)
    finally:
        for kind in kinds:
            unregister_kind(kind.name)


class Spread(Kind):
    """A custom kind stated by its columns alone: (n, Σ weight), (max, -min)."""

    name = "test_spread"
    sum_columns = ("selected", "weight")
    max_columns = ("value", "negated_value")

    def result_columns(self, sums: np.ndarray, maxes: np.ndarray, *_: Any) -> tuple:
        return {"n": sums[:, 0], "range": maxes[:, 0] + maxes[:, 1]}, sums[:, 0] != 0


def test_a_kind_stated_by_its_columns_matches_numpy() -> None:
    """A kind that declares its slots as columns needs no reduce (``Kind.reduce``
    reduces its columns), beside the built-in kinds; its results are numpy's on the
    selected elements."""
    kind = register_kind(Spread())
    try:
        assert (kind.num_sums, kind.num_maxes) == (2, 2)
        rng = np.random.default_rng(3)
        t = Tracker()
        data: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        for call in range(40):
            name = f"s{call % 5}"
            x, w = rng.normal(size=7), rng.choice([0.0, 0.5, 2.0], size=7)
            t.log(name, torch.from_numpy(x) if call % 2 else x, weight=w, kind=kind.name)
            t.mean(f"m{call % 3}", float(x[0]))  # a built-in kind beside it
            data.setdefault(name, []).append((x, w))
        got = t.compute()
        for name, calls in data.items():
            x = np.concatenate([c[0] for c in calls])
            w = np.concatenate([c[1] for c in calls])
            chosen = x[w > 0]
            assert got[f"{name}/n"] == len(chosen)
            assert got[f"{name}/range"] == chosen.max() - chosen.min()
    finally:
        unregister_kind(kind.name)


def test_a_kind_declaring_an_unknown_column_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_columns names unknown columns \['median'\]"):
        register_kind(make(Spread, name="test_bad_columns", max_columns=("value", "median")))
    assert get_kind("mean").name == "mean"


def _reduced_alone(kind: Kind) -> Kind:
    """``kind`` under another name, with a ``reduce`` of its own (the default's)."""
    cls = type(kind)
    return type(f"Alone{cls.__name__}", (cls,), {
        "name": f"alone_{kind.name}", "reduce": lambda self, batch: Kind.reduce(self, batch),
    })()  # fmt: skip


@pytest.mark.parametrize("nonfinite", ["propagate", "skip", "error"])
def test_declared_column_kinds_equal_their_twins_with_an_own_reduce(nonfinite: str) -> None:
    """Kinds stated by their columns (mean, sum, max, min) give bit for bit what a twin
    with a ``reduce`` of its own gives, with numbers, masked arrays, tensors on both
    paths, NaN and inf, empty metrics, a replacing and an extra kind interleaved, and a
    mid-step fold (dist's mean sums its values in the order they are kept, which need
    not be the twin's)."""
    builtin = [get_kind(name) for name in ("mean", "sum", "max", "min")]
    alone = [register_kind(_reduced_alone(kind)) for kind in builtin]
    try:
        rng = np.random.default_rng(11)
        t = Tracker(nonfinite=nonfinite)
        for step in range(3):
            for call in range(60):
                i = rng.integers(len(builtin))
                name = f"{builtin[i].name}{rng.integers(4)}"
                x = rng.normal(size=rng.integers(1, 5)) * 10.0 ** rng.integers(-3, 4)
                w = rng.choice([0.0, 1.0, 3.0], size=len(x)) if rng.random() < 0.5 else None
                number = w is None and rng.random() < 0.3
                # under "error" a non-finite array is rejected at compute(), which then
                # raises for the step: only numbers (refused in the call) get one there
                if rng.random() < 0.15 and (number or nonfinite != "error"):
                    x[0] = rng.choice([math.nan, math.inf, -math.inf])
                value: Any = float(x[0]) if number else x
                if not number and rng.random() < 0.5:
                    t.reduce_host_data_with_numpy = bool(rng.random() < 0.5)
                    value = torch.from_numpy(x)
                for kind in (builtin[i], alone[i]):
                    with contextlib.suppress(ValueError):  # "error" refuses a number at once
                        t.log(f"{kind.name}/{name}", value, weight=w, kind=kind.name)
                if call % 7 == 0:
                    t.last("lr", float(call))
                    t.std("std", rng.normal(size=3))
                if call == 30:
                    t._fold()  # mid-step, between two pairs of calls
            got = t.compute()
            pairs = [
                (key, value, got.get(f"alone_{key}"))
                for key, value in got.items()
                if key.split("/")[0] in ("mean", "sum", "max", "min")
            ]
            assert pairs, step
            for key, value, twin in pairs:
                assert np.array_equal(value, twin, equal_nan=True), (key, value, twin)
    finally:
        for kind in alone:
            unregister_kind(kind.name)
