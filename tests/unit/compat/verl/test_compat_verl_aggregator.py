"""rlmetrics.compat.verl.MetricsAggregator: verl's per-step reduction, on exact states.

The first section checks the behaviour verl's own tests pin down for its
``verl.trainer.ppo.v1.utils.MetricsAggregator`` (written here from those cases'
behaviour); the rest checks what rlmetrics adds: exact merging of per-iteration
states over any split of a step, explicit kinds, and clear errors.
"""

from __future__ import annotations

import math
import pickle
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmetrics import Tracker, TrackerState
from rlmetrics.compat.verl import Metric, MetricsAggregator
from rlmetrics.compat.verl.aggregator import DAPO_FILTERED_REWARD_COUNTS_KEY


def aggregate(*iterations: tuple[dict, int], **kwargs) -> dict:
    """Feed ``(metrics, sample_count)`` iterations to a new aggregator, return its result."""
    agg = MetricsAggregator(**kwargs)
    for metrics, count in iterations:
        agg.add_step_metrics(metrics, sample_count=count)
    return agg.get_aggregated_metrics()


# -- verl's cases ------------------------------------------------------------------
def test_nothing_added_gives_empty_dict():
    assert MetricsAggregator().get_aggregated_metrics() == {}


@pytest.mark.parametrize("key", ["critic/vf_loss/mean", "critic/vf_loss"])
def test_means_weight_by_sample_count(key):
    # explicit "mean" and no keyword at all both take the sample-weighted mean
    out = aggregate(({key: 5.0}, 2), ({key: -1.0}, 6))
    assert out[key] == pytest.approx((5.0 * 2 - 1.0 * 6) / 8)


def test_extrema_take_max_and_min_over_iterations():
    agg = MetricsAggregator()
    for value in (2.0, -4.0, 9.0):
        agg.add_step_metrics({"score/max": value, "score/min": value})
    out = agg.get_aggregated_metrics()
    assert (out["score/max"], out["score/min"]) == (9.0, -4.0)


def test_timings_and_totals_add_up():
    out = aggregate(
        ({"timing_s/gen": 0.25, "timing_per_token_ms/gen": 1.0, "perf/total_num_tokens": 7}, 0),
        ({"timing_s/gen": 0.5, "timing_per_token_ms/gen": 2.0, "perf/total_num_tokens": 5}, 0),
    )
    assert out == {
        "timing_s/gen": pytest.approx(0.75),
        "timing_per_token_ms/gen": pytest.approx(3.0),
        "perf/total_num_tokens": pytest.approx(12.0),
    }


@pytest.mark.parametrize(
    "key",
    [
        "training/off_policy/evicted_samples",
        "validation/off_policy/evicted_samples",
        "training/filter_groups/evicted_samples",
        "training/filter_groups/discarded_surplus_samples",
        "validation/filter_groups/discarded_surplus_samples",
        "training/rollout_failure/evicted_samples",
    ],
)
def test_eviction_counts_add_up(key):
    assert aggregate(({key: 4}, 10), ({key: 1}, 10))[key] == pytest.approx(5.0)


def test_eviction_staleness_is_weighted_by_evicted_count():
    stale = "training/off_policy/evicted_samples_staleness/mean"
    count = "training/off_policy/evicted_samples"
    out = aggregate(({count: 2, stale: 6.0}, 50), ({count: torch.tensor(6), stale: 2.0}, 1))
    assert out[stale] == pytest.approx((2 * 6.0 + 6 * 2.0) / 8)
    # without the count in the same dict, the sample count weighs it
    assert aggregate(({stale: 6.0}, 1), ({stale: 2.0}, 3))[stale] == pytest.approx(3.0)


@pytest.mark.parametrize(
    "key", ["training/global_step", "training/rollout_probs_diff_valid", "actor/lr", "lr"]
)
def test_last_value_wins(key):
    assert aggregate(({key: 3}, 1), ({key: 1}, 5), ({key: 2}, 0))[key] == 2.0


def test_counts_add_up():
    key = "training/rollout_logprobs_mismatch_count"
    assert aggregate(({key: 0}, 0), ({key: 3}, 0), ({key: 2}, 0))[key] == pytest.approx(5.0)


def test_seqlen_range_is_recomputed_from_the_step_extrema():
    out = aggregate(
        ({"global_seqlen/min": 4.0, "global_seqlen/max": 9.0, "global_seqlen/minmax_diff": 5.0}, 1),
        ({"global_seqlen/min": 6.0, "global_seqlen/max": 12.0, "global_seqlen/minmax_diff": 6}, 1),
    )
    assert (out["global_seqlen/min"], out["global_seqlen/max"]) == (4.0, 12.0)
    assert out["global_seqlen/minmax_diff"] == pytest.approx(8.0)


def test_seqlen_range_alone_takes_the_max():
    diff = "global_seqlen/minmax_diff"
    assert aggregate(({diff: 2.0}, 1), ({diff: 8.0}, 1), ({diff: 5.0}, 1))[diff] == 8.0


def test_scalar_tensors_count_and_others_are_skipped():
    out = aggregate(
        ({"a/mean": torch.tensor(1.0), "vec": torch.ones(3), "name": "x", "none": None}, 1),
        ({"a/mean": torch.tensor([5.0]), "arr": np.array([2.0])}, 1),
    )
    assert out == {"a/mean": pytest.approx(3.0), "arr": 2.0}


def test_bools_are_skipped():
    out = aggregate(({"done": True, "flag": np.bool_(False), "x/mean": 2.0}, 0))
    assert out == {"x/mean": 2.0}


def test_reset_forgets_everything():
    agg = MetricsAggregator()
    agg.add_step_metrics({"x/mean": 1.0, DAPO_FILTERED_REWARD_COUNTS_KEY: {1.0: 2}}, 3)
    agg.reset()
    assert agg.step_count == 0
    assert agg.get_aggregated_metrics() == {}
    agg.add_step_metrics({"x/mean": 4.0}, 1)
    assert agg.get_aggregated_metrics() == {"x/mean": 4.0}


def test_a_key_missing_from_some_iterations_uses_the_others():
    out = aggregate(({"x/mean": 1.0}, 2), ({"y": 0.0}, 1000), ({"x/mean": 4.0}, 1))
    assert out["x/mean"] == pytest.approx(2.0)


def test_unweighted_iterations_take_the_plain_mean():
    # no sample_count anywhere: verl falls back to the plain mean of the values
    assert aggregate(({"x": 1.0}, 0), ({"x": 4.0}, 0))["x"] == pytest.approx(2.5)
    # a zero-weight iteration among weighted ones does not count
    assert aggregate(({"x": 1.0}, 0), ({"x": 4.0}, 2))["x"] == pytest.approx(4.0)


def test_dapo_reward_counts_add_up_per_reward():
    key = DAPO_FILTERED_REWARD_COUNTS_KEY
    out = aggregate(({key: {0.0: 1, 1.0: 4}}, 8), ({key: {1.0: 2, 0.5: 1}}, 8), ({}, 8))
    assert out[key] == {0.0: 1, 1.0: 6, 0.5: 1}


# -- what rlmetrics adds -----------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=6),
    seed=st.integers(0, 2**31 - 1),
)
def test_iteration_states_merge_to_the_whole_step(sizes, seed):
    """Per-iteration Tracker states give the step's values for any split of its tokens."""
    rng = np.random.default_rng(seed)
    tokens = sum(sizes) + 1
    x, mask = rng.normal(size=tokens), rng.random(tokens) < 0.7
    mask[-1] = True  # at least one counted token in the step
    sizes = [*sizes, 1]
    agg, start = MetricsAggregator(), 0
    for size in sizes:
        piece = slice(start, start + size)
        start += size
        tracker = Tracker()
        tracker.mean("actor/pg_clipfrac", x[piece], mask=mask[piece])
        tracker.sum("actor/tokens", mask[piece].astype(float))
        tracker.max("actor/ratio_max", x[piece], mask=mask[piece])
        agg.add_step_metrics(tracker.state(), sample_count=size)
    out = agg.get_aggregated_metrics()
    assert out["actor/pg_clipfrac"] == pytest.approx(x[mask].mean(), rel=1e-12, abs=1e-12)
    assert out["actor/tokens"] == mask.sum()
    assert out["actor/ratio_max"] == x[mask].max()
    assert agg.step_count == len(sizes)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 8), min_size=1, max_size=6), seed=st.integers(0, 2**31))
def test_sample_means_reduce_to_the_mean_over_all_samples(sizes, seed):
    """Per-iteration means of sample values, weighted by sample_count: the step's mean."""
    x = np.random.default_rng(seed).normal(size=sum(sizes))
    agg, start = MetricsAggregator(), 0
    for size in sizes:
        agg.add_step_metrics({"critic/score/mean": float(x[start : start + size].mean())}, size)
        start += size
    assert agg.get_aggregated_metrics()["critic/score/mean"] == pytest.approx(x.mean(), abs=1e-12)


def test_metric_states_and_compat_metrics_merge_by_their_kind():
    clipfrac = Metric("mean")
    clipfrac.append(0.5, weight=2)
    first = {"actor/pg_clipfrac": clipfrac, "actor/timing_max": Metric("sum", 3.0)}
    second_tracker = Tracker()
    second_tracker.mean("actor/pg_clipfrac", [0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    second = {"actor/pg_clipfrac": second_tracker.state().metrics["actor/pg_clipfrac"]}
    out = aggregate((first, 100), (second, 1))
    # tokens weigh, not the sample counts; the key spelling ("max") is not consulted
    assert out["actor/pg_clipfrac"] == pytest.approx((0.5 * 2 + 1.0) / 8)
    assert out["actor/timing_max"] == 3.0


def test_kinds_override_the_spelling():
    key = "response/terminated_ratio"  # verl's substring rule reads "min" in it
    iterations = (({key: 0.25}, 1), ({key: 0.75}, 3))
    assert aggregate(*iterations)[key] == 0.25
    assert aggregate(*iterations, kinds={key: "mean"})[key] == pytest.approx(0.625)


def test_state_pickles_and_merges_across_aggregators():
    worker, driver = MetricsAggregator(), MetricsAggregator()
    worker.add_step_metrics({"x/mean": 1.0, "n/total": 2}, sample_count=1)
    driver.add_step_metrics({"x/mean": 4.0, "n/total": 5}, sample_count=2)
    driver.add_step_metrics(pickle.loads(pickle.dumps(worker.state())))
    out = driver.get_aggregated_metrics()
    assert out == {"x/mean": pytest.approx(3.0), "n/total": 7.0}


def test_last_states_of_later_iterations_replace_earlier_ones():
    """Iterations are in time order: a `last` state is replaced by a later one's (a
    merge as of ranks would report their mean and warn), as a number is."""
    agg = MetricsAggregator()
    for lr in (1.0, 2.0, 3.0):
        tracker = Tracker()
        tracker.last("actor/lr", lr, weight=lr < 3.0)  # the third iteration logs no value
        tracker.sum("n/total", 1.0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            agg.add_step_metrics(tracker.state(), sample_count=1)
    assert agg.get_aggregated_metrics() == {"actor/lr": 2.0, "n/total": 3.0}
    assert agg.state().compute() == {"actor/lr": 2.0, "n/total": 3.0}


def test_nonfinite_values_propagate():
    out = aggregate(({"x/mean": math.inf}, 1), ({"x/mean": 1.0}, 1))
    assert out["x/mean"] == math.inf


# -- bad input ---------------------------------------------------------------------
def test_unknown_kind_is_named():
    with pytest.raises(ValueError, match="'x' has kind 'median'"):
        MetricsAggregator(kinds={"x": "median"})


@pytest.mark.parametrize("count", [-1, math.nan, "3", None])
def test_bad_sample_count_is_rejected(count):
    with pytest.raises(ValueError, match="sample_count"):
        MetricsAggregator().add_step_metrics({"x": 1.0}, sample_count=count)


def test_a_key_with_two_kinds_is_named():
    agg = MetricsAggregator()
    agg.add_step_metrics({"actor/clip_max": 1.0}, 1)
    with pytest.raises(ValueError, match="actor/clip_max"):
        agg.add_step_metrics({"actor/clip_max": Metric("mean", 2.0)}, 1)


def test_an_empty_state_is_an_iteration():
    agg = MetricsAggregator()
    agg.add_step_metrics(TrackerState({}))
    assert agg.step_count == 1
    assert agg.get_aggregated_metrics() == {}
