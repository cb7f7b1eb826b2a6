"""Tracker semantics: errors, non-finite policies, empty metrics, steps, prefixes, no syncs."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from rlmetrics import (
    Kind,
    MetricState,
    ModifiedInputError,
    Tracker,
    TrackerState,
    register_kind,
    unregister_kind,
)
from rlmetrics.kinds import last
from rlmetrics.kinds.dist import DEFAULT_QUANTILES, quantile_suffix
from rlmetrics.tracker import LogTarget, PrefixedTracker

from helpers import SyncTrap, log_every_kind, no_host_copies, reference, trap

NAN, INF = math.nan, math.inf


pytestmark = pytest.mark.usefixtures("log_path")  # host and tensor paths


def filled(nonfinite: str = "propagate") -> Tracker:
    """A tracker holding one metric of each kind, from python numbers and tensors."""
    t = Tracker(nonfinite=nonfinite)
    t.mean("mean", 1.0, weight=2.0)
    t.mean("mean", torch.tensor([4.0, 10.0]), weight=torch.tensor([1.0, 0.0]))
    t.sum("sum", 3)
    t.sum("sum", np.array([1.5, 2.5]))
    t.max("max", torch.tensor([-1.0, 5.0]))
    t.min("min", -2.0)
    t.std("std", torch.tensor([1.0, 3.0], dtype=torch.float64))
    t.last("last", 0.5)
    t.dist("dist", [1.0, 2.0, 3.0, 4.0])
    return t


FILLED = {
    "mean": 2.0,
    "sum": 7.0,
    "max": 5.0,
    "min": -2.0,
    "std": 1.0,
    "last": 0.5,
    "dist/mean": 2.5,
    "dist/std": float(np.std([1.0, 2.0, 3.0, 4.0])),
    "dist/min": 1.0,
    "dist/max": 4.0,
    "dist/p50": 2.5,
    "dist/p90": float(np.quantile([1.0, 2.0, 3.0, 4.0], 0.9)),
    "dist/p99": float(np.quantile([1.0, 2.0, 3.0, 4.0], 0.99)),
}


def test_filled_tracker_reports_exact_values() -> None:
    assert filled().compute() == FILLED


# -- errors, and that each loses nothing ------------------------------------------------------
def test_same_name_two_kinds_names_the_metric_and_both_kinds() -> None:
    t = filled()
    with pytest.raises(ValueError, match=r"metric 'mean' .*kind 'mean'.* kind 'sum'"):
        t.sum("mean", 1.0)
    with pytest.raises(ValueError, match=r"metric 'std' .*kind 'std'.* kind 'dist'"):
        t.dist("std", torch.ones(3))
    assert t.compute() == FILLED


def test_merging_states_of_two_kinds_names_both_and_changes_nothing() -> None:
    t, other = filled(), Tracker()
    other.max("sum", 1.0)
    other.mean("new", 1.0)
    with pytest.raises(ValueError, match=r"metric 'sum' is kind 'sum' here but 'max'"):
        t.merge(other)
    with pytest.raises(ValueError, match=r"metric 'sum' is kind 'sum' in one state and 'max'"):
        t.state().merge(other.state())
    assert "new" not in t
    assert t.compute() == FILLED


def test_merge_rejects_other_types() -> None:
    with pytest.raises(TypeError, match="merge expects a Tracker or TrackerState, got dict"):
        Tracker().merge({})


def _histogram(edges: list[float]) -> Kind:
    from rlmetrics.kinds.histogram import Histogram

    unregister_kind("test_merge_hist")
    return register_kind(Histogram(name="test_merge_hist", edges=edges))


BAD_STATES = {  # made when a test runs
    "fewer slots": lambda: MetricState("mean", (1.0,)),
    "more sum slots": lambda: MetricState("mean", (1.0, 2.0, 3.0)),
    "more max slots": lambda: MetricState("max", (1.0,), (2.0, 3.0)),
    "std extra of another length": lambda: MetricState("std", (), (), (1.0, 2.0)),
    "std extra missing": lambda: MetricState("std", (), (), None),
    "unknown kind": lambda: MetricState("no_such_kind", (1.0,)),
    "another configuration": lambda: MetricState(
        "mean", (1.0, 1.0), fingerprint="mean:2:0:0:other"
    ),
}


@pytest.mark.parametrize("bad", list(BAD_STATES))
@pytest.mark.parametrize("route", ["merge", "load_state_dict", "TrackerState.merge"])
def test_a_merge_that_fails_changes_nothing(bad: str, route: str) -> None:
    """Every incoming metric is checked (slot counts, extra, kind, configuration) before
    any is merged: the good metrics next to a bad one are not applied either."""
    t = filled()
    before = t.state_dict()
    good = {"mean": MetricState("mean", (100.0, 1.0)), "fresh": MetricState("sum", (1.0, 1.0))}
    state = TrackerState({**good, "zz_bad": BAD_STATES[bad]()})
    with pytest.raises(ValueError, match=r"'zz_bad'|no_such_kind"):
        if route == "merge":
            t.merge(state)
        elif route == "load_state_dict":
            t.load_state_dict(state.to_dict())
        else:
            t.merge(t.state().merge(state))
    assert t.state_dict() == before
    assert t.compute() == FILLED


def test_histogram_states_with_other_edges_do_not_merge() -> None:
    """Same slot count, other edges: the counts would land in the wrong bins."""
    _histogram([0.0, 1.0, 2.0])
    try:
        made = Tracker()
        made.log("h", [0.5, 1.5, 1.5], kind="test_merge_hist")
        state = made.state()
        saved = made.state_dict()
        _histogram([0.0, 10.0, 20.0])
        t = Tracker()
        t.log("h", [5.0], kind="test_merge_hist")
        before = t.state_dict()
        for attempt in (lambda: t.merge(state), lambda: t.load_state_dict(saved)):
            with pytest.raises(ValueError, match=r"metric 'h': kind 'test_merge_hist' is "):
                attempt()
            assert t.state_dict() == before
        with pytest.raises(ValueError, match="different configurations"):
            t.state().merge(state)
        _histogram([0.0, 1.0, 2.0])
        assert Tracker().merge(state).compute()["h/bin_1"] == pytest.approx(2 / 3)
    finally:
        unregister_kind("test_merge_hist")


def test_states_saved_without_a_fingerprint_still_load() -> None:
    saved = filled().state_dict()
    for metric in saved["metrics"].values():
        del metric["fingerprint"]
    t = Tracker()
    t.load_state_dict(saved)
    assert t.compute() == FILLED


@pytest.mark.parametrize(
    "value",
    ["1.0", None, object(), {"a": 1}, 1 + 2j, np.array(["a"]), torch.tensor([1j])],
    ids=["str", "none", "object", "dict", "complex", "str_array", "complex_tensor"],
)
def test_non_numeric_value_is_a_type_error_naming_the_metric(value: object) -> None:
    t = filled()
    with pytest.raises(TypeError, match=r"metric 'mean': value must be"):
        t.mean("mean", value)
    with pytest.raises(TypeError, match=r"metric 'fresh': value must be"):
        t.max("fresh", value)
    with pytest.raises(TypeError, match=r"metric 'mean': weight must be"):
        t.mean("mean", torch.ones(2), weight="1")
    assert "fresh" not in t  # a failed first call leaves no empty metric behind
    assert t.compute() == FILLED


def test_bad_names_are_rejected() -> None:
    t = Tracker()
    with pytest.raises(TypeError, match="metric names must be strings, got int 3"):
        t.mean(3, 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="metric names must be strings, got list"):
        t.mean(["a"], 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="metric names must not be empty"):
        t.mean("", 1.0)
    assert len(t) == 0


@pytest.mark.parametrize(
    ("value", "weight", "shapes"),
    [
        (torch.ones(3), torch.ones(2), r"\(2,\) does not match value shape \(3,\)"),
        (np.ones((2, 3)), np.ones(6), r"\(6,\) does not match value shape \(2, 3\)"),
        (1.0, torch.ones(3, dtype=torch.bool), r"\(3,\) does not match value shape \(\)"),
        ([1.0, 2.0], [[1.0, 1.0]], r"\(1, 2\) does not match value shape \(2,\)"),
    ],
)
def test_weight_shape_mismatch(value: object, weight: object, shapes: str) -> None:
    t = filled()
    with pytest.raises(ValueError, match=r"metric 'mean': weight shape " + shapes):
        t.mean("mean", value, weight=weight)
    with pytest.raises(ValueError, match=r"metric 'max': weight shape " + shapes):
        t.max("max", value, mask=weight)
    assert t.compute() == FILLED


@pytest.mark.parametrize("weight", [-1.0, -1, NAN, INF, np.float32(-0.5)])
def test_bad_python_weight_raises_at_once(weight: object) -> None:
    t = filled()
    with pytest.raises(ValueError, match=r"metric 'mean': weights must be finite and >= 0"):
        t.mean("mean", 1.0, weight=weight)
    with pytest.raises(ValueError, match=r"metric 'std': weights must be finite and >= 0"):
        t.std("std", torch.ones(2), weight=weight)
    with pytest.raises(ValueError, match=r"metric 'new': weights must be finite and >= 0"):
        t.mean("new", 1.0, weight=weight)
    assert "new" not in t
    assert t.compute() == FILLED


@pytest.mark.parametrize(
    "weight", [torch.tensor([1.0, -1.0]), np.array([-0.5, 1.0]), torch.tensor([NAN, 1.0])]
)
def test_bad_tensor_weight_raises_at_compute_and_the_call_is_dropped(weight: object) -> None:
    """Checking tensor data at the log call would sync, so the error comes at compute()."""
    t = filled()
    t.mean("mean", torch.tensor([100.0, 200.0]), weight=weight)  # no error yet
    t.std("new", torch.tensor([1.0, 2.0]), weight=weight)
    with pytest.raises(
        ValueError,
        match=r"rank: 'mean' \(mean\): 1 \(1 with a negative or non-\S+ weight\*\); 'new'",
    ):
        t.compute()
    assert t.compute() == FILLED  # reported once; everything else is intact


def test_bad_tensor_weight_raises_at_state_too() -> None:
    t = filled()
    t.sum("sum", torch.ones(2), mask=torch.tensor([-1.0, 1.0]))
    with pytest.raises(ValueError, match=r"'sum' \(sum\): 1"):
        t.state()
    assert t.state().compute() == FILLED


# -- non-finite policies -------------------------------------------------------------------
def test_propagate_gives_what_the_arithmetic_gives() -> None:
    t = Tracker()
    t.mean("mean", torch.tensor([1.0, INF]))
    t.sum("sum", -INF)
    t.max("max", torch.tensor([1.0, NAN]))
    t.min("min", NAN)
    t.min("min", 0.0)
    t.std("std", [1.0, NAN])
    t.dist("dist", [1.0, INF])
    other = Tracker()
    other.max("max", 3.0)  # a NaN survives merges in either order
    other.min("min", torch.tensor([-1.0]))
    out = Tracker().merge(other).merge(t).compute()
    assert out["mean"] == INF and out["sum"] == -INF and out["dist/max"] == INF
    assert all(math.isnan(out[k]) for k in ("max", "min", "std", "dist/std"))
    assert not any("nonfinite_count" in key for key in out)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_skip_drops_nonfinite_elements_and_counts_them(as_tensor: bool) -> None:
    values = [1.0, NAN, 3.0, INF, -INF, 5.0]
    mask = [True, True, True, False, True, False]  # a masked-out inf neither counts nor adds
    t = Tracker(nonfinite="skip")
    for kind in ("mean", "sum", "max", "min", "std", "dist"):
        if as_tensor:
            t.log(kind, torch.tensor(values), torch.tensor(mask), kind=kind)
        else:
            for value, keep in zip(values, mask, strict=True):
                t.log(kind, value, keep, kind=kind)
    t.last("last", 2.0)
    t.last("last", torch.tensor(NAN) if as_tensor else NAN)  # keeps the previous value
    out = t.compute()
    finite = [1.0, 3.0]
    for kind in ("mean", "sum", "max", "min", "std", "dist"):
        for key, value in reference(kind, kind, np.array(finite), None).items():
            assert out.pop(key) == pytest.approx(value, rel=1e-15), key
        assert out.pop(f"{kind}/nonfinite_count") == 2.0
    assert out == {"last": 2.0, "last/nonfinite_count": 1.0}


def test_skip_reports_an_all_nonfinite_metric_by_its_count_only() -> None:
    t = Tracker(nonfinite="skip")
    t.mean("x", torch.tensor([NAN, INF]))
    assert t.compute() == {"x/nonfinite_count": 2.0}


def test_error_policy_python_raises_at_once_naming_the_metric() -> None:
    t = filled("error")
    with pytest.raises(ValueError, match=r"metric 'mean': non-finite value nan"):
        t.mean("mean", NAN)
    with pytest.raises(ValueError, match=r"metric 'max': non-finite value -inf"):
        t.max("max", -INF, mask=True)
    t.max("max", -INF, mask=False)  # masked out: contributes nothing, raises nothing
    assert t.compute() == FILLED


def test_error_policy_tensor_raises_at_compute_then_reports_the_rest() -> None:
    t = filled("error")
    t.dist("dist", torch.tensor([7.0, INF]))
    t.last("last", torch.tensor(NAN))
    t.mean("mean", torch.tensor([1.0, 2.0]))  # a good tensor call after the bad ones
    with pytest.raises(
        ValueError, match=r"'dist' \(dist\): 1 \(1 with a non-finite value\); 'last' \(last\): 1 \("
    ):
        t.compute()
    assert t.compute() == {**FILLED, "mean": (2.0 + 4.0 + 3.0) / 5}


def test_unknown_policies_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"Tracker\(empty=...\) must be one of"):
        Tracker(empty="zero")
    with pytest.raises(ValueError, match=r"Tracker\(nonfinite=...\) must be one of"):
        Tracker(nonfinite="ignore")


# -- empty metrics --------------------------------------------------------------------------
def _empty_everywhere(t: Tracker) -> None:
    t.mean("mean", torch.ones(2), weight=torch.zeros(2))
    t.mean("mean", 1.0, weight=0.0)
    t.sum("sum", torch.zeros(0))
    t.max("max", 5.0, mask=False)
    t.min("min", torch.ones(3), mask=torch.zeros(3, dtype=torch.bool))
    t.std("std", np.zeros(0))
    t.dist("dist", [1.0], mask=[False])


def test_empty_metrics_are_omitted() -> None:
    t = Tracker()
    _empty_everywhere(t)
    assert len(t) == 6
    assert t.compute() == {}
    assert Tracker().compute() == {}


def test_empty_nan_reports_nan_for_every_key() -> None:
    t = Tracker(empty="nan")
    _empty_everywhere(t)
    out = t.compute()
    dist_keys = [f"dist/{s}" for s in ("mean", "std", "min", "max")]
    dist_keys += [f"dist/{quantile_suffix(q)}" for q in DEFAULT_QUANTILES]
    assert sorted(out) == sorted(["mean", "sum", "max", "min", "std", *dist_keys])
    assert all(math.isnan(v) for v in out.values())


# -- steps -----------------------------------------------------------------------------
def test_compute_resets_and_reset_false_keeps_accumulating() -> None:
    t = Tracker()
    t.mean("loss", torch.tensor([1.0, 2.0]))
    assert t.compute(reset=False) == {"loss": 1.5}
    t.mean("loss", 6.0)
    assert t.compute(reset=False) == {"loss": 3.0}
    assert t.compute() == {"loss": 3.0}
    assert t.compute() == {}
    t.sum("loss", 1.0)  # a new step may use the name with another kind
    assert t.compute() == {"loss": 1.0}


def test_last_keeps_the_latest_on_a_rank() -> None:
    t = Tracker()
    t.last("lr", 1.0)
    t.last("lr", torch.tensor([2.0]))
    assert t.compute(reset=False) == {"lr": 2.0}
    t.last("lr", np.float32(0.5))
    assert t.compute(reset=False) == {"lr": 0.5}
    t.last("lr", torch.tensor(0.25, dtype=torch.float64))
    assert t.compute() == {"lr": 0.25}
    with pytest.raises(ValueError, match=r"metric 'lr' \(kind 'last'\) takes one value"):
        t.last("lr", torch.ones(2))


def test_last_across_sources_must_agree_or_warns_once(log_path: str) -> None:
    name = f"lr_disagree_{log_path}"  # warned once until it agrees: a name per run
    a, b = Tracker(), Tracker()
    a.last(name, 1.0)
    b.last(name, torch.tensor(3.0))
    state = a.state().merge(b.state())
    with pytest.warns(RuntimeWarning, match=f"'{name}' .*min 1.0, max 3.0, 2 sources"):
        assert state.compute() == {name: 2.0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert state.compute() == {name: 2.0}  # warned once only
        a.last(name, 3.0)
        assert a.merge(b).compute() == {name: 3.0}


def test_last_warns_again_when_its_sources_disagree_after_agreeing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A disagreement warns once while it lasts (not every step), and again once the
    values have agreed and then disagree again, even with the same values under
    Python's once-per-message filter ("default")."""
    monkeypatch.setattr(last, "_warned", set())  # warnings are per name and process
    monkeypatch.setattr(last, "_disagreements", {}, raising=False)
    name = "lr_disagrees_again"

    def merged(mine: float, other: float) -> float | None:
        a, b = Tracker(), Tracker()
        a.last(name, mine, weight=float(not math.isnan(mine)))  # NaN: no value
        b.last(name, other, weight=float(not math.isnan(other)))
        return a.merge(b).compute().get(name)

    # one source with a value (step 4) or none (step 5) neither agrees nor disagrees
    nan = math.nan
    steps = [(1, 3), (1, 5), (2, 2), (1, 3), (1, nan), (nan, nan), (1, 3), (4, 4), (1, 3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        values = [merged(*step) for step in steps]
    assert values == [2, 3, 2, 2, 1, None, 2, 4, 2]  # the mean where they disagree
    messages = [str(w.message) for w in caught]
    assert len(messages) == 3, messages  # steps 0, 3 and 8
    for number, message in enumerate(messages, 1):
        assert f"Disagreement {number} of this metric in this process" in message
        assert message.startswith(f"metric '{name}' (kind 'last'): merged values disagree")
        assert f"Disagreement {number} of this metric" in message


def test_dist_quantiles_are_configurable() -> None:
    x = np.arange(11.0) ** 2
    t = Tracker(quantiles=(0.25, 0.999))
    t.dist("x", torch.from_numpy(x[:4]))
    t.dist("x", x[4:])
    out = t.compute()
    assert out["x/p25"] == np.quantile(x, 0.25)
    assert out["x/p99.9"] == np.quantile(x, 0.999)
    with pytest.raises(ValueError, match="dist quantiles must lie in"):
        Tracker(quantiles=(1.5,))


def test_dist_quantile_labels_are_exact_and_unique() -> None:
    """Close quantiles get their own exact labels (6 significant digits made 0.9999999
    'p100' and let neighbours overwrite each other); a repeated quantile is rejected."""
    quantiles = (0.9999999, 0.99999999, 0.999999, 1.0, 0.07, 1 / 3, 0.0, 1e-10)
    labels = ["p99.99999", "p99.999999", "p99.9999", "p100", "p7", "p33.33333333333333", "p0",
              "p0.00000001"]  # fmt: skip
    x = np.arange(1000.0) ** 1.5
    t = Tracker(quantiles=quantiles)
    t.dist("x", x)
    out = t.compute()
    assert len(out) == 4 + len(quantiles)
    for q, label in zip(quantiles, labels, strict=True):
        assert out[f"x/{label}"] == np.quantile(x, q), label
    for bad in ((0.5, 0.9, 0.5), (0.25, 0.25)):
        with pytest.raises(
            ValueError, match=r"dist quantiles must be distinct, got 0\.\d+ repeated"
        ):
            Tracker(quantiles=bad)
    from rlmetrics.kinds.histogram import Histogram

    with pytest.raises(ValueError, match=r"Histogram 'h': quantiles must be distinct"):
        Histogram(name="h", edges=[0.0, 1.0], quantiles=(0.5, 0.5))


def _tracker_fed_from_refilled_buffers() -> Tracker:
    """A tracker given ``dist`` "t" from one CPU tensor and "a" from one numpy array,
    each refilled in place between two calls (t: 1 then 2; a: 3 then 4)."""
    t = Tracker()
    buffer, array = torch.zeros(2, dtype=torch.float64), np.zeros(2)
    for value in (1.0, 2.0):
        buffer.fill_(value)
        array.fill(value + 2)
        t.dist("t", buffer)
        t.dist("a", array)
    return t


def test_reusing_a_logged_buffer_never_rewrites_what_was_logged() -> None:
    """A logged numpy array and a logged CPU tensor are copied: a buffer refilled before
    compute() leaves each call's values as logged."""
    t = _tracker_fed_from_refilled_buffers()
    out = t.compute()
    assert (out["a/min"], out["a/max"], out["a/mean"]) == (3.0, 4.0, 3.5)
    assert (out["t/min"], out["t/max"], out["t/mean"]) == (1.0, 2.0, 1.5)


@pytest.mark.usefixtures("cpu_tensors_by_reference")
def test_a_refilled_tensor_kept_by_reference_raises_naming_the_metric() -> None:
    """A tensor recorded by reference (a device tensor's record) changed in place
    before compute() raises, naming the metric (its logged value is gone), and the
    other metrics stay."""
    t = _tracker_fed_from_refilled_buffers()
    with pytest.raises(ModifiedInputError, match=r"changed in place.*'t'"):
        t.compute()
    out = t.compute()
    assert (out["a/min"], out["a/max"], out["a/mean"]) == (3.0, 4.0, 3.5)
    assert not any(key.startswith("t/") for key in out)


@pytest.mark.parametrize(
    "make",
    [
        lambda x: torch.tensor(x, requires_grad=True),
        lambda x: torch.tensor(x, dtype=torch.bfloat16),
        lambda x: torch._neg_view(-torch.tensor(x, dtype=torch.float64)),
        lambda x: torch.tensor([x, [9.0, 9.0]]).t()[:, 0],  # a strided view
        lambda x: np.require(np.asarray(x), requirements="C").copy().view(),
        lambda x: _read_only(np.asarray(x)),
    ],
    ids=["requires-grad", "bfloat16", "neg-bit", "strided", "view", "read-only"],
)
def test_unusual_host_inputs_log_like_plain_ones(make) -> None:
    x = [1.5, 2.5]
    expected, got = Tracker(), Tracker()
    for t, value in ((expected, x), (got, make(x))):
        for kind in ("mean", "sum", "max", "min", "std", "dist"):
            t.log(kind, value, kind=kind)
    assert got.compute() == expected.compute()


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def test_cpu_and_array_data_reduce_on_the_host_device_tensors_do_not() -> None:
    t = Tracker()
    t.reduce_host_data_with_numpy = True
    t.mean("cpu", torch.ones(3))
    t.mean("array", np.ones(3))
    t.reduce_host_data_with_numpy = False
    t.mean("tensor_path", torch.ones(3))
    devices = {name: records.record_device for name, records in t._metric_records.items()}
    assert devices == {"cpu": None, "array": None, "tensor_path": torch.device("cpu")}
    t.device()  # folds the records into the states
    table, rows = t._table, {name: records.row for name, records in t._metric_records.items()}
    host = {name: table.sums[table.sum_at[row]] for name, row in rows.items()}
    device = {name: float(table.device_part.sums[table.sum_at[row]]) for name, row in rows.items()}
    assert host == {"cpu": 3.0, "array": 3.0, "tensor_path": 0.0}
    assert device == {"cpu": 0.0, "array": 0.0, "tensor_path": 3.0}


SHARED_KINDS = ("mean", "sum", "max", "min", "std", "dist")


@pytest.mark.parametrize(
    ("value", "weight"),
    [
        (torch.tensor([1.5, -2.0, 4.0, 0.25]), torch.tensor([True, False, True, True])),
        (np.array([1.5, -2.0, 4.0, 0.25]), np.array([1.0, 0.0, 2.0, 0.5])),
        ([1.5, -2.0, 4.0, math.inf], None),
        (2.5, 3.0),
        (torch.tensor(7.0, dtype=torch.float64), None),
    ],
    ids=["tensor-mask", "array-weights", "list-inf", "number", "0-d"],
)
@pytest.mark.parametrize("policy", ["propagate", "skip"])
def test_log_shared_equals_one_call_per_metric(value, weight, policy: str) -> None:
    shared, separate = Tracker(nonfinite=policy), Tracker(nonfinite=policy)
    metrics = [(f"x/{kind}", kind) for kind in SHARED_KINDS]
    shared.prefixed("p/").log_shared(metrics, value, weight)
    for name, kind in metrics:
        separate.log("p/" + name, value, weight, kind=kind)
    np.testing.assert_equal(shared.compute(), separate.compute())  # NaN equals NaN


def test_log_shared_fails_like_one_call_per_metric() -> None:
    """Metrics before the failing one are logged; the failing one is not created."""
    t = Tracker()
    with pytest.raises(ValueError, match=r"metric 'b' \(kind 'last'\) takes one value"):
        t.log_shared([("a", "mean"), ("b", "last"), ("c", "max")], torch.tensor([1.0, 3.0]))
    assert t.schema() == {"a": "mean"}
    with pytest.raises(TypeError, match="metric 'd': value must be a number"):
        t.log_shared([("d", "mean"), ("e", "max")], "text")
    assert t.schema() == {"a": "mean"}
    assert t.compute() == {"a": 2.0}


def test_name_clash_between_result_keys_is_reported() -> None:
    t = Tracker()
    t.dist("x", 1.0)
    t.mean("x/mean", 1.0)
    with pytest.raises(ValueError, match=r"metric 'x/mean' reports 'x/mean'.*'x'"):
        t.compute()


# -- prefixes -------------------------------------------------------------------------------
def test_a_subclass_that_overrides_log_sees_every_log_call() -> None:
    """Every log call goes through ``_log``: a subclass that overrides it (as
    ``rlmetrics.cli.audit.RecordingTracker`` does) sees every call, made on the tracker or
    a prefixed view, by kind method or kind name, with or without a mask; each kind's
    method is written once, in ``LogTarget``."""

    class Seeing(Tracker):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, str]] = []

        def _log(self, name: str, kind: str, value: object, *call: object) -> None:
            self.seen.append((name, kind))
            super()._log(name, kind, value, *call)

    t = Seeing()
    view = t.prefixed("p/")
    t.mean("a", 1.0)
    t.sum("b", torch.ones(2), mask=torch.tensor([True, False]))
    view.max("c", 2.0)
    view.prefixed("q/").min("d", torch.tensor(3.0))
    t.log("e", [1.0, 2.0], kind="std")
    view.log("f", 4.0, kind="last")
    expected = [("a", "mean"), ("b", "sum"), ("p/c", "max"), ("p/q/d", "min")]
    assert t.seen == [*expected, ("e", "std"), ("p/f", "last")]
    assert t.compute() == {"a": 1.0, "b": 1.0, "e": 0.5, "p/c": 2.0, "p/f": 4.0, "p/q/d": 3.0}
    kinds = ("mean", "sum", "max", "min", "std", "last", "dist", "quantile", "log")
    assert all(getattr(cls, kind) is getattr(LogTarget, kind)
               for cls in (Tracker, Seeing, PrefixedTracker) for kind in kinds)  # fmt: skip


def test_prefixed_views_log_into_the_same_tracker() -> None:
    t = Tracker()
    actor = t.prefixed("actor/")
    actor.mean("pg_loss", torch.tensor([1.0, 3.0]), weight=torch.tensor([True, True]))
    t.mean("actor/pg_loss", 5.0)
    actor.prefixed("opt/").last("lr", 1e-3)
    actor.prefixed("opt/").prefixed("x/").sum("n", 2)
    actor.log("entropy", [0.5, 1.5], kind="std")
    with pytest.raises(ValueError, match=r"metric 'actor/pg_loss' .*'mean'.*'max'"):
        actor.max("pg_loss", 1.0)
    assert t.compute() == {
        "actor/entropy": 0.5,
        "actor/opt/lr": 1e-3,
        "actor/opt/x/n": 2.0,
        "actor/pg_loss": 3.0,
    }
    with pytest.raises(TypeError, match="prefix must be a string, got int"):
        t.prefixed(1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="metric names must be strings"):
        actor.mean(None, 1.0)  # type: ignore[arg-type]


# -- no host sync in the log path ---------------------------------------------------------------
@pytest.fixture
def armed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Arm SyncTrap, and forbid copying host data to a tensor's device while armed."""
    for factory in ("tensor", "as_tensor"):
        monkeypatch.setattr(torch, factory, no_host_copies(getattr(torch, factory)))
    SyncTrap.armed = True
    yield
    SyncTrap.armed = True


def test_sync_trap_catches_syncs_through_ops(armed: None) -> None:
    x = trap([1.0, 2.0])
    assert type((x * 2).sum()) is SyncTrap
    for sync in (
        lambda: (x * 2).sum().item(),
        lambda: x.tolist(),
        lambda: bool(x[0] > 0),
        lambda: float(x[0]),
        lambda: x.cpu(),
        lambda: x.numpy(),
    ):
        with pytest.raises(AssertionError, match="host sync in the log path"):
            sync()


@pytest.mark.parametrize("policy", ["propagate", "skip", "error"])
@pytest.mark.usefixtures("cpu_tensors_by_reference")
def test_log_calls_never_sync(armed: None, policy: str) -> None:
    """Every log method, with tensor values, weights and masks: no host sync until compute."""
    x = [1.0, 2.0, 4.0, 8.0]
    w = [1.0, 0.0, 2.0, 1.0]
    m = [True, False, True, True]
    t = Tracker(nonfinite=policy)
    view = t.prefixed("p/")
    t.mean("mean", 0.5)  # a host part next to the device part
    t.mean("mean", trap(x), weight=trap(w, torch.float64))
    view.mean("mean", trap(x), weight=trap(m, torch.bool))
    view.mean("mean", 3.0, weight=trap(1.0))
    t.mean("mean", trap(2.0), weight=2.0)
    t.sum("sum", trap(x, torch.int64), mask=trap(m, torch.bool))
    t.max("max", trap(x), mask=trap(m, torch.bool))
    t.min("min", trap(x, torch.bfloat16))
    t.std("std", trap(x), weight=trap(w))
    t.std("std", 16.0)
    t.last("last", 1.0)
    t.last("last", trap(0.5))
    t.last("last", 0.25)
    t.last("last", trap([0.125]))
    t.dist("dist", trap(x), mask=trap(m, torch.bool))
    t.dist("dist", 16.0)
    t.log("log", trap(x), trap(m, torch.bool), kind="sum")
    t.mean("masked_nan", trap([1.0, NAN, -INF]), weight=trap([2.0, 0.0, 0.0]))
    t.last("last_masked", trap([NAN]), weight=trap([False], torch.bool))
    SyncTrap.armed = False  # compute() is where the host may wait
    out = t.compute()
    xs = np.array(x)
    assert out["mean"] == (0.5 + 1 + 8 + 8 + 4) / 7
    assert out["p/mean"] == (1 + 4 + 8 + 3) / 4
    assert out["sum"] == out["log"] == 13.0
    assert (out["max"], out["min"], out["last"]) == (8.0, 1.0, 0.125)
    assert out["std"] == pytest.approx(
        reference("std", "s", np.append(xs, 16.0), np.append(w, 1.0))["s"], rel=1e-15
    )
    assert out["dist/p50"] == 6.0
    assert out["masked_nan"] == 1.0 and "last_masked" not in out


# -- one way to pass a weight ---------------------------------------------------------------------
METHODS = ("mean", "sum", "max", "min", "std", "dist", "last")


@pytest.mark.parametrize("method", METHODS)
def test_every_log_call_takes_weight_and_mask_alike(method: str) -> None:
    """``weight=`` everywhere, ``mask=`` as its alias; a bool mask means the same for
    every kind (and the same as a 0/1 weight)."""
    x = [1.0, 4.0, -2.0, 8.0] if method != "last" else [3.0]
    m = [True, False, True, True] if method != "last" else [True]
    runs = []
    for how in ("weight=", "mask=", "log weight=", "log mask=", "log_shared", "0/1 weight"):
        t = Tracker()
        view = t.prefixed("p/")
        if how == "weight=":
            getattr(view, method)("x", torch.tensor(x), weight=torch.tensor(m))
        elif how == "mask=":
            getattr(view, method)("x", torch.tensor(x), mask=torch.tensor(m))
        elif how == "log weight=":
            view.log("x", torch.tensor(x), weight=torch.tensor(m), kind=method)
        elif how == "log mask=":
            view.log("x", torch.tensor(x), kind=method, mask=torch.tensor(m))
        elif how == "log_shared":
            view.log_shared([("x", method)], torch.tensor(x), mask=torch.tensor(m))
        else:
            getattr(view, method)("x", x, weight=[float(b) for b in m])
        runs.append(t.compute())
    kept = np.array(x)[np.array(m)]
    expected = reference(method, "p/x", kept[-1:] if method == "last" else kept, None)
    for out in runs:
        assert out == pytest.approx(expected, rel=1e-15)
    with pytest.raises(TypeError, match=r"metric 'x': pass weight= or mask= .*not both"):
        getattr(Tracker(), method)("x", 1.0, weight=1.0, mask=True)


def test_weight_multiplies_for_mean_std_sum_and_selects_for_the_others() -> None:
    x, w = np.array([1.0, 4.0, -2.0, 8.0]), np.array([2.0, 0.0, 0.5, 1.0])
    t = Tracker()
    for method in ("mean", "sum", "std", "max", "min", "dist"):
        getattr(t, method)(method, torch.tensor(x), weight=torch.tensor(w))
    t.sum("sum_py", 3.0, weight=2.0)
    t.sum("sum_py", 5, weight=0)
    t.max("max_py", 3.0, weight=0.25)
    t.max("max_py", 9.0, weight=0)
    t.last("last", 1.0, weight=2.0)
    t.last("last", 2.0, weight=0.0)
    out = t.compute()
    assert out.pop("sum") == float(np.sum(w * x)) == 9.0
    assert out.pop("sum_py") == 6.0 and out.pop("max_py") == 3.0 and out.pop("last") == 1.0
    for method in ("mean", "std"):
        assert out.pop(method) == pytest.approx(reference(method, "m", x, w)["m"], rel=1e-15)
    kept = x[w > 0]
    assert out == pytest.approx(
        {**reference("max", "max", kept, None), **reference("min", "min", kept, None),
         **reference("dist", "dist", kept, None)},
        rel=1e-15,
    )  # fmt: skip


# -- custom kinds ----------------------------------------------------------------------------
class Range(Kind):
    """max - min of the selected elements (the example of docs/concepts.md)."""

    name = "test_range"
    sum_columns = ("selected",)  # the number of elements selected
    max_columns = ("value", "negated_value")  # (max x, max -x); -inf where none

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        if state.sums[0] == 0:
            return None
        high, neg_low = state.maxes
        return {"": high + neg_low}


def test_custom_kind_logs_merges_and_reports() -> None:
    register_kind(Range())
    try:
        with pytest.raises(ValueError, match="kind 'test_range' is already registered"):
            register_kind(Range())
        a, b = Tracker(), Tracker()
        a.log(
            "r", torch.tensor([1.0, 9.0, 4.0]), torch.tensor([True, False, True]), kind="test_range"
        )
        a.log("r", 2.5, kind="test_range")
        b.log("r", -0.5, kind="test_range")
        b.log("r", 100.0, 0.0, kind="test_range")
        b.log("unused", torch.zeros(0), kind="test_range")
        out = Tracker(empty="nan").merge(a).merge(TrackerState().merge(b.state())).compute()
        assert out["r"] == 4.5
        assert math.isnan(out["unused"])
    finally:
        unregister_kind("test_range")
    with pytest.raises(ValueError, match="unknown kind 'test_range'"):
        Tracker().log("x", 1.0, kind="test_range")


# -- compute()'s vectorised results equal the per-metric results of the same state -----
VALUES = (0.0, -1.5, 2.25, 1e8, math.nan, math.inf, -math.inf)


@pytest.mark.parametrize("empty", ["omit", "nan"])
@pytest.mark.parametrize("seed", range(6))
def test_vectorised_results_equal_per_metric_results(empty: str, seed: int) -> None:
    """``compute()`` reads results from the packed buffers a kind at a time; the same
    state through ``TrackerState.compute`` goes metric by metric: they must agree."""
    rng = np.random.default_rng(seed)
    tracker = Tracker(empty=empty, nonfinite="skip" if seed % 3 == 0 else "propagate")
    for i in range(40):
        kind = ("mean", "sum", "max", "min", "last", "std", "dist")[i % 7]
        name = f"m{i % 23}_{kind}"
        size = int(rng.integers(0, 4))
        values = rng.choice(VALUES, size) if rng.random() < 0.3 else rng.normal(0, 3, size)
        if kind == "last":
            tracker.last(name, float(values[0]) if size else 0.5)
        elif rng.random() < 0.5:
            mask = torch.from_numpy(rng.random(size) < 0.6)
            arg = {"weight": mask} if kind in ("mean", "std") else {"mask": mask}
            tracker.log(name, torch.from_numpy(values), arg.popitem()[1], kind=kind)
        else:
            for value in values:
                tracker.log(name, float(value), kind=kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # 'last' disagreement, none here
        fast = tracker.compute(reset=False)
        slow = tracker.state().compute(empty=empty)
    assert list(fast) == list(slow)
    for key, value in slow.items():
        assert fast[key] == value or (math.isnan(fast[key]) and math.isnan(value)), key


def test_reused_metric_records_start_empty() -> None:
    """A name's MetricRecords are kept across steps and cleared on reuse: nothing of the
    last step (values, counts, device parts, extras, kind) leaks into the next."""

    def second_step(t: Tracker) -> None:
        t.mean("x", 4.0)
        t.dist("d", [7.0])
        t.max("k", -1.0)  # "k" was a mean: another kind, other records

    t = Tracker(nonfinite="skip")
    t.reduce_host_data_with_numpy = False
    t.mean("x", torch.tensor([1.0, math.nan]))  # device part and a non-finite count
    t.dist("d", [1.0, 2.0, 3.0])
    t.mean("k", 5.0)
    kept = t._metric_records["x"]
    first = t.compute()
    assert first["x"] == 1.0 and first["x/nonfinite_count"] == 1.0 and first["d/max"] == 3.0
    second_step(t)
    assert t._metric_records["x"] is kept
    fresh = Tracker(nonfinite="skip")
    fresh.reduce_host_data_with_numpy = False
    second_step(fresh)
    assert t.compute() == fresh.compute()


def test_names_that_come_and_go_do_not_pile_up() -> None:
    t = Tracker()
    for step in range(2000):
        t.mean(f"once/{step}", 1.0)
        t.mean("always", 1.0)
        t.compute()
    assert len(t._pool) <= 2 * 2 + 256 + 1


def test_packed_results_equal_the_state_results() -> None:
    """``compute()`` reads the results from the packed buffers; ``state().compute()``
    from the per-metric states: the same bits, for every kind and policy, many metrics
    or few."""
    rng = np.random.default_rng(0)
    batch = {"value": rng.normal(size=64), "weight": rng.random(64), "mask": rng.random(64) < 0.5}
    other = Tracker()
    other.last("replica/disagrees", 2.0)
    for empty in ("omit", "nan"):
        for many in (0, 40):
            t = Tracker(empty=empty, nonfinite="skip")
            for start in range(0, 64, 16):
                log_every_kind(t, batch, np.arange(start, start + 16))
            for i in range(many):
                t.log(f"many/{i}", float(rng.normal()), kind=("mean", "sum", "max", "min")[i % 4])
            t.mean("nan", math.nan)
            t.min("inf", -math.inf)
            t.last("replica/agrees", 1.0)
            t.last("replica/disagrees", 1.0)
            t.max("empty", [1.0], mask=[False])
            t.merge(other.state())
            with warnings.catch_warnings():  # the disagreement warns (once while it lasts)
                warnings.simplefilter("ignore", RuntimeWarning)
                expected = t.state().compute(empty=empty)
                got = t.compute()
            assert got["replica/disagrees"] == 1.5  # the mean, through ``result``
            assert list(got) == list(expected)
            for key, value in got.items():
                assert value == expected[key] or (math.isnan(value) and math.isnan(expected[key]))


def test_results_follow_ieee_arithmetic_on_edge_values() -> None:
    """NaN, ±inf, -0.0, zero weights and empty metrics come out as the arithmetic on the
    whole batch gives them, under both empty policies."""
    for empty in ("omit", "nan"):
        t = Tracker(empty=empty)
        t.mean("mean", [1.0, 2.0], weight=[0.25, 3.0])
        t.mean("mean/zero_weight", 1.0, weight=0.0)
        t.mean("mean/nan", math.nan)
        t.sum("sum/inf", [math.inf, 1.0])
        t.max("max/-0", -0.0)
        t.max("max/empty", [1.0], mask=[False])
        t.min("min/-inf", [-math.inf, 3.0])
        t.last("last", 0.1)
        t.last("last/-0", 2.0)
        t.last("last/-0", -0.0)
        t.last("last/-0 tensor", torch.tensor(-0.0, dtype=torch.float64))
        t.last("last/nan", math.nan)
        got = t.compute()
        assert got["mean"] == (0.25 + 6.0) / 3.25 and got["sum/inf"] == math.inf
        assert math.isnan(got["mean/nan"]) and got["min/-inf"] == -math.inf
        assert got["max/-0"] == 0.0 and math.copysign(1, got["max/-0"]) == -1
        assert got["last"] == 0.1 and math.isnan(got["last/nan"])
        for name in ("last/-0", "last/-0 tensor"):
            assert got[name] == 0.0 and math.copysign(1, got[name]) == -1, name
        for name in ("mean/zero_weight", "max/empty"):
            assert (name in got) == (empty == "nan") and (empty == "omit" or math.isnan(got[name]))


def test_a_name_whose_first_call_failed_does_not_disturb_the_next_steps() -> None:
    """A failed first call leaves no metric, but its name's row stays in the table; the
    packing built for the other metrics must keep working (it once indexed past it)."""
    t = Tracker()
    for step in range(3):
        t.mean("a", 1.0 + step)
        t.max("b", [2.0, float(step)])
        if step == 1:
            with pytest.raises(ValueError, match="'new'"):
                t.mean("new", [1.0, 2.0], weight=[1.0])
        assert t.compute() == {"a": 1.0 + step, "b": 2.0}
        assert "new" not in t
