"""rlmetrics.compat.verl: verl.utils.metric's behaviour, and exact weighted reduction."""

from __future__ import annotations

import math
import pickle
import warnings

import numpy as np
import pytest
import torch

from rlmetrics import Tracker, TrackerState
from rlmetrics.compat.verl import (
    AggregationType,
    Metric,
    append_to_dict,
    from_tracker_state,
    reduce_metrics,
    to_tracker_state,
)

VALUES = [3.0, -1.5, 7.25, 0.5]


# -- AggregationType and construction ------------------------------------------------
@pytest.mark.parametrize("name", ["mean", "sum", "min", "max"])
def test_aggregation_type_from_string(name):
    assert AggregationType(name).value == name
    assert Metric(name).aggregation is AggregationType(name)
    assert Metric(AggregationType(name)).aggregation is AggregationType(name)


@pytest.mark.parametrize("bad", ["median", "MEAN", "", "avg"])
def test_unknown_aggregation_raises(bad):
    with pytest.raises(ValueError, match=repr(bad)):
        AggregationType(bad)
    with pytest.raises(ValueError):
        Metric(bad)


def test_non_string_aggregation_raises():
    with pytest.raises(ValueError, match="Unsupported aggregation type"):
        Metric(3)


def test_init_with_value_list_tuple_tensor_and_numpy():
    assert Metric("sum", 2.0).values == [2.0]
    assert Metric("sum", [1, 2, 3]).values == [1, 2, 3]
    assert Metric("sum", (1.0, 2.0)).values == [1.0, 2.0]
    assert Metric("mean", torch.tensor(2.5)).values == [2.5]
    assert Metric("mean", torch.tensor([4.0])).values == [4.0]
    assert Metric("mean", np.float32(0.5)).values == [0.5]
    assert Metric("mean", []).values == []
    assert Metric("mean").values == []


@pytest.mark.parametrize("bad", [torch.ones(2), torch.ones(2, 2), np.ones(3), torch.ones(0)])
def test_non_scalar_tensor_raises(bad):
    with pytest.raises(ValueError, match="Only scalar tensors"):
        Metric("mean", bad)
    with pytest.raises(ValueError, match="Only scalar tensors"):
        Metric("mean").append(bad)


@pytest.mark.parametrize("bad", ["1.0", None, object()])
def test_non_numeric_value_raises(bad):
    with pytest.raises(ValueError, match="Unsupported value type"):
        Metric("mean").append(bad)


# -- aggregate -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "reference"), [("mean", np.mean), ("sum", np.sum), ("min", np.min), ("max", np.max)]
)
def test_aggregate_matches_numpy(name, reference):
    metric = Metric(name, VALUES[0])
    for value in VALUES[1:]:
        metric.append(value)
    assert metric.aggregate() == reference(VALUES)


def test_empty_metric_aggregates_to_nan_or_zero_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert math.isnan(Metric("mean").aggregate())
        assert math.isnan(Metric("min").aggregate())
        assert math.isnan(Metric("max").aggregate())
        assert Metric("sum").aggregate() == 0.0  # np.sum([]), as in verl


# -- append / extend / chain / from_dict / init_list ---------------------------------
def test_append_metric_extends():
    metric = Metric("sum", 1.0)
    metric.append(Metric("sum", [2.0, 3.0]))
    assert metric.values == [1.0, 2.0, 3.0]


def test_extend_with_list_and_metric():
    metric = Metric("max")
    metric.extend([1.0, 5.0])
    metric.extend(Metric("max", 2.0))
    assert metric.values == [1.0, 5.0, 2.0]
    assert metric.aggregate() == 5.0


def test_extend_mismatched_aggregation_raises():
    with pytest.raises(ValueError, match="Aggregation type mismatch"):
        Metric("mean", 1.0).extend(Metric("sum", 1.0))
    with pytest.raises(ValueError, match="Aggregation type mismatch"):
        Metric("mean", 1.0).append(Metric("max", 1.0))


def test_chain_nothing_gives_empty_mean():
    chained = Metric.chain([])
    assert chained.aggregation is AggregationType.MEAN
    assert chained.values == []
    assert math.isnan(chained.aggregate())


def test_chain_concatenates_and_checks_kinds():
    chained = Metric.chain([Metric("min", [3.0, 1.0]), Metric("min", 2.0)])
    assert chained.aggregation is AggregationType.MIN
    assert chained.values == [3.0, 1.0, 2.0]
    assert chained.aggregate() == 1.0
    with pytest.raises(ValueError, match="Aggregation type mismatch"):
        Metric.chain([Metric("min", 1.0), Metric("max", 1.0)])


def test_from_dict_and_init_list():
    metrics = Metric.from_dict({"a": 1.0, "b": [2.0, 4.0]}, aggregation="mean")
    assert {k: m.aggregate() for k, m in metrics.items()} == {"a": 1.0, "b": 3.0}
    empty = metrics["a"].init_list()
    assert isinstance(empty, Metric)
    assert empty.aggregation is AggregationType.MEAN
    assert empty.values == []


def test_metric_pickles():
    metric = Metric("mean")
    metric.append(1.0, weight=2.0)
    clone = pickle.loads(pickle.dumps(metric))
    assert (clone.values, clone.weights, clone.aggregation) == ([1.0], [2.0], metric.aggregation)


def test_aggregate_dp_as_verl():
    ranks = [Metric("mean", [1.0, 2.0]), Metric("mean", [3.0, 6.0])]
    assert Metric.aggregate_dp(ranks) == np.mean(np.mean([[1.0, 2.0], [3.0, 6.0]], axis=0))
    ranks = [Metric("sum", [1.0, 2.0]), Metric("sum", [3.0, 6.0])]
    assert Metric.aggregate_dp(ranks) == 6.0  # sum over positions of the mean over ranks
    assert Metric.aggregate_dp([Metric("max", [1.0, 9.0]), Metric("max", [3.0, 2.0])]) == 9.0
    with pytest.raises(ValueError, match="as many values"):
        Metric.aggregate_dp([Metric("mean", [1.0]), Metric("mean", [1.0, 2.0])])
    with pytest.raises(ValueError, match="empty"):
        Metric.aggregate_dp([])


# -- reduce_metrics --------------------------------------------------------------------
def test_reduce_plain_lists_by_name_in_place():
    metrics = {
        "loss": [1.0, 2.0, 3.0],
        "max_reward": [5.0, 8.0, 6.0],
        "min_error": [0.1, 0.05, 0.2],
        "response_length/max": [3, 9],
        "tensors": [torch.tensor(1.0), torch.tensor(3.0)],
    }
    out = reduce_metrics(metrics)
    assert out is metrics
    assert out == {
        "loss": 2.0,
        "max_reward": 8.0,
        "min_error": 0.05,
        "response_length/max": 9.0,
        "tensors": 2.0,
    }


def test_reduce_name_rule_checks_max_before_min():
    assert reduce_metrics({"seq/min_max_gap": [1.0, 4.0]}) == {"seq/min_max_gap": 4.0}


def test_reduce_empty_list_gives_nan():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = reduce_metrics({"loss": [], "x/max": [], "x/min": []})
    assert all(math.isnan(v) for v in out.values())


def test_reduce_metric_uses_its_kind_not_its_name():
    out = reduce_metrics({"max_len": Metric("mean", [1.0, 3.0]), "total": Metric("sum", [1, 2])})
    assert out == {"max_len": 2.0, "total": 3.0}


def test_metric_mixed_with_plain_values_under_one_key():
    data: dict = {}
    append_to_dict(data, {"loss": 1.0})  # a plain value first: the key holds a list
    append_to_dict(data, {"loss": Metric("max", [7.0, 2.0])})
    append_to_dict(data, {"loss": [4.0]})
    assert reduce_metrics(dict(data)) == {"loss": 7.0}  # the Metric's kind decides
    data = {}
    append_to_dict(data, {"loss": Metric("mean", 1.0)})  # a Metric first: the key is one
    append_to_dict(data, {"loss": [2.0, 3.0]})
    append_to_dict(data, {"loss": 6.0})
    assert isinstance(data["loss"], Metric)
    assert reduce_metrics(data) == {"loss": 3.0}


def test_mixed_metric_kinds_under_one_key_raise():
    with pytest.raises(ValueError, match="'loss' holds Metrics of kinds"):
        reduce_metrics({"loss": [Metric("mean", 1.0), Metric("sum", 1.0)]})


# -- append_to_dict --------------------------------------------------------------------
def test_append_to_dict_prefix_and_lists():
    data: dict = {}
    append_to_dict(data, {"a": 1.0, "actor/b": [1.0, 2.0]}, prefix="actor/")
    append_to_dict(data, {"a": 2.0}, prefix="actor/")
    assert data == {"actor/a": [1.0, 2.0], "actor/b": [1.0, 2.0]}


def test_append_to_dict_starts_metrics_with_their_kind():
    data: dict = {}
    append_to_dict(data, {"m": Metric("min", 3.0)})
    append_to_dict(data, {"m": Metric("min", 1.0)})
    assert data["m"].aggregation is AggregationType.MIN
    assert data["m"].values == [3.0, 1.0]
    with pytest.raises(ValueError, match="Aggregation type mismatch"):
        append_to_dict(data, {"m": Metric("max", 1.0)})


# -- weights and states ----------------------------------------------------------------
def test_weighted_mean_and_masking_weights():
    mean = Metric("mean")
    mean.append(1.0, weight=1)
    mean.append(3.0, weight=3)
    assert mean.aggregate() == 2.5
    assert mean.values == [1.0, 3.0] and mean.weights == [1.0, 3.0]
    peak = Metric("max")
    peak.append(9.0, weight=0)  # weight 0 drops the value
    peak.append(2.0, weight=5)
    assert peak.aggregate() == 2.0
    with pytest.raises(ValueError, match="finite and >= 0"):
        mean.append(1.0, weight=-1.0)
    with pytest.raises(ValueError, match="2 values but 1 weights"):
        mean.extend([1.0, 2.0], weights=[1.0])


def test_weights_survive_extend_chain_and_append_to_dict():
    a, b = Metric("mean"), Metric("mean")
    a.append(1.0, weight=3.0)
    b.append(5.0, weight=1.0)
    assert Metric.chain([a, b]).aggregate() == 2.0
    data: dict = {}
    append_to_dict(data, {"x": a})
    append_to_dict(data, {"x": b})
    assert data["x"].weights == [3.0, 1.0]
    assert reduce_metrics(data) == {"x": 2.0}


@pytest.mark.parametrize("name", ["mean", "sum", "min", "max"])
def test_state_round_trip(name):
    metric = Metric(name)
    for value, weight in zip(VALUES, [1.0, 2.0, 0.5, 4.0], strict=True):
        metric.append(value, weight=weight)
    state = metric.to_state()
    assert state.kind == name
    back = Metric.from_state(state)
    assert back.aggregation is metric.aggregation
    assert back.aggregate() == pytest.approx(metric.aggregate(), rel=1e-15)
    assert TrackerState({"m": state}).compute() == {"m": pytest.approx(metric.aggregate())}


def test_empty_state_round_trip_and_unknown_kind():
    for name in ("mean", "sum", "min", "max"):
        state = Metric(name).to_state()
        assert TrackerState({"m": state}).compute() == {}
        assert Metric.from_state(state).values == []
    tracker = Tracker()
    tracker.std("s", 1.0)
    with pytest.raises(ValueError, match="not 'std'"):
        from_tracker_state(tracker.state())


def test_tracker_state_round_trip():
    metrics = {"loss": Metric("mean", [1.0, 2.0]), "len/max": Metric("max", [3.0, 8.0])}
    state = to_tracker_state(metrics)
    assert state.compute() == {"len/max": 8.0, "loss": 1.5}
    assert {k: m.aggregate() for k, m in from_tracker_state(state).items()} == {
        "loss": 1.5,
        "len/max": 8.0,
    }
    tracker = Tracker()
    tracker.merge(state)  # a Tracker takes it like any worker's state
    tracker.mean("loss", 4.5, weight=2.0)
    assert tracker.compute()["loss"] == pytest.approx((1.0 + 2.0 + 9.0) / 4.0)


# -- exact global values where verl's mean of means is off ---------------------------
def make_worker_batches(seed: int = 0):
    """4 workers, each with micro-batches of different numbers of tokens."""
    rng = np.random.default_rng(seed)
    workers = []
    for _ in range(4):
        sizes = rng.integers(1, 300, size=int(rng.integers(2, 6)))
        workers.append([rng.normal(2.0, 3.0, size=int(n)) for n in sizes])
    return workers


def worker_metrics(micro_batches, *, weighted: bool) -> dict[str, Metric]:
    """What a verl worker's loss loop returns: one Metric per metric name."""
    out: dict[str, Metric] = {}
    for tokens in micro_batches:
        weight = float(tokens.size) if weighted else 1.0
        step = {"actor/pg_loss": Metric("mean"), "actor/max_loss": Metric("max")}
        step["actor/pg_loss"].append(torch.tensor(tokens.mean()), weight=weight)
        step["actor/max_loss"].append(float(tokens.max()))
        append_to_dict(out, step)
    return out


def test_weighted_metrics_give_exact_global_values_where_verl_is_off():
    workers = make_worker_batches()
    everything = np.concatenate([t for w in workers for t in w])
    truth = {"actor/pg_loss": float(np.mean(everything)), "actor/max_loss": float(everything.max())}

    # verl: unweighted Metrics, per-rank aggregates, then the driver's mean over ranks
    verl_ranks = [worker_metrics(w, weighted=False) for w in workers]
    per_rank = {"actor/pg_loss": [r["actor/pg_loss"].aggregate() for r in verl_ranks]}
    verl_value = reduce_metrics(per_rank)["actor/pg_loss"]
    assert abs(verl_value - truth["actor/pg_loss"]) > 1e-3  # mean of means is off

    # rlmetrics, driver side: the same calls, weighted Metrics
    ranks = [worker_metrics(w, weighted=True) for w in workers]
    driver: dict = {}
    for rank in ranks:
        append_to_dict(driver, rank)
    reduced = reduce_metrics(driver)
    assert reduced["actor/max_loss"] == truth["actor/max_loss"]
    assert reduced["actor/pg_loss"] == pytest.approx(truth["actor/pg_loss"], rel=1e-13, abs=1e-15)

    # or via states: each worker returns a small TrackerState, the driver merges
    merged = TrackerState.merge_all([to_tracker_state(rank) for rank in ranks]).compute()
    assert merged["actor/max_loss"] == truth["actor/max_loss"]
    assert merged["actor/pg_loss"] == pytest.approx(truth["actor/pg_loss"], rel=1e-13, abs=1e-15)
