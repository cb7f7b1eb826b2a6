"""rlmetrics.compat.verl.FullyAsyncMetricsAggregator: verl's fully-async reduction, exact.

Same calls as ``verl.experimental.fully_async_policy.detach_utils.MetricsAggregator``;
means weighted by sample count; the step ratios recomputed from the reduced totals.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlmetrics import Tracker
from rlmetrics.compat.verl import FullyAsyncMetricsAggregator

UTIL = "dynamic_resource/"


def aggregate(*iterations, gpus=(8, 0, 0), rollout_util=None, **kwargs) -> dict:
    """Feed ``(metrics, sample_count)`` iterations, return the aggregated dict."""
    agg = FullyAsyncMetricsAggregator(*gpus, **kwargs)
    for metrics, count in iterations:
        agg.add_step_metrics(metrics, count)
    return agg.get_aggregated_metrics(rollout_util)


@pytest.mark.parametrize(
    "key", ["actor/kl/mean", "reward/avg", "actor/entropy", "critic/score_max/mean"]
)
def test_means_are_weighted_by_sample_count(key):
    # "mean" wins over "max" in this class's order (the v1 class reads it as max)
    out = aggregate(({key: 1.0}, 1), ({key: 3.0}, 3))
    assert out[key] == pytest.approx(2.5)  # verl: the plain mean, 2.0


def test_rules_by_name():
    keys = {
        "timing_s/gen": 0.5,
        "perf/time_per_step": 2.0,
        "fully_async/count/current_param_version": 7,
        "dynamic_resource/mq_size": 3,
        "critic/score/max": 4.0,
        "critic/score/min": -4.0,
        "timing_s/agent_loop/tool_calls/max": 9.0,
        "perf/total_num_tokens": 10,
    }
    second = {key: value / 2 for key, value in keys.items()}
    out = aggregate((keys, 1), (second, 1))
    assert out["timing_s/gen"] == pytest.approx(0.75)
    assert out["perf/time_per_step"] == pytest.approx(3.0)
    assert out["fully_async/count/current_param_version"] == 3.5
    assert out["dynamic_resource/mq_size"] == 1.5
    assert (out["critic/score/max"], out["critic/score/min"]) == (4.0, -4.0)
    assert out["timing_s/agent_loop/tool_calls/max"] == 9.0
    assert out["perf/total_num_tokens"] == 15.0


def test_bools_are_recorded_as_numbers():
    out = aggregate(({"ok": True}, 1), ({"ok": False}, 3))
    assert out["ok"] == pytest.approx(0.25)


def test_throughput_and_idle_ratio_come_from_the_totals():
    first = {
        "perf/throughput": 1.0,
        "perf/total_num_tokens": 300,
        "perf/time_per_step": 2.0,
        "timing_s/gen": 1.0,
        "timing_s/step": 2.0,
    }
    second = {**first, "perf/total_num_tokens": 100, "perf/time_per_step": 3.0}
    out = aggregate((first, 1), (second, 1), gpus=(4, 0, 0))
    assert out["perf/throughput"] == pytest.approx(400 / (5.0 * 4))
    assert out["fully_async/trainer/idle_ratio"] == pytest.approx(2.0 / 4.0)


def test_resource_utilisation():
    metrics = {
        UTIL + "train_compute_time_s": 3.0,
        UTIL + "train_allocated_time_s": 4.0,
        "timing_s/step": 10.0,
        "timing_s/wait_for_enough_samples": 2.5,
    }
    out = aggregate((metrics, 1), (metrics, 1), gpus=(8, 2, 6), rollout_util=0.5)
    train, x = 6.0 / 8.0, 5.0 / 20.0
    assert out[UTIL + "train_resource_utilization"] == pytest.approx(train)
    assert out[UTIL + "rollout_resource_utilization"] == 0.5
    expected = ((1 - x) * 2 * train + (x * 2 + 6) * 0.5) / 8
    assert out[UTIL + "resource_utilization"] == pytest.approx(expected)
    # without the rollouter's figure, or with no GPUs to weigh, neither is reported
    for kwargs in ({"gpus": (8, 2, 6)}, {"gpus": (8, 0, 0), "rollout_util": 0.5}):
        assert UTIL + "resource_utilization" not in aggregate((metrics, 1), **kwargs)


def test_zero_allocated_time_gives_no_train_utilisation():
    metrics = {UTIL + "train_compute_time_s": 1.0, UTIL + "train_allocated_time_s": 0.0}
    assert UTIL + "train_resource_utilization" not in aggregate((metrics, 1))


def test_seqlen_range_without_extrema_takes_the_max():
    # verl raises KeyError here; the reduced value is kept
    assert aggregate(({"global_seqlen/minmax_diff": 3.0}, 1))["global_seqlen/minmax_diff"] == 3.0


def test_counts_timestamps_and_reset():
    agg = FullyAsyncMetricsAggregator(total_gpus=2)
    agg.add_step_metrics({"x": torch.tensor(1.0)}, 4, timestamp=5.0)
    agg.add_step_metrics({"x": np.float32(2.0)}, 6)
    assert agg.sample_counts == [4, 6] and agg.timestamps[0] == 5.0 and len(agg.timestamps) == 2
    assert agg.get_aggregated_metrics() == {"x": pytest.approx(1.6)}
    agg.reset()
    assert (agg.sample_counts, agg.timestamps, agg.step_count) == ([], [], 0)
    assert agg.get_aggregated_metrics() == {}


def test_iteration_states_merge_exactly():
    agg = FullyAsyncMetricsAggregator(total_gpus=1)
    tokens = [np.arange(5.0), np.arange(1.0)]
    for piece in tokens:
        tracker = Tracker()
        tracker.mean("actor/pg_clipfrac", piece)
        agg.add_step_metrics(tracker.state(), 1)
    expected = np.concatenate(tokens).mean()
    assert agg.get_aggregated_metrics()["actor/pg_clipfrac"] == pytest.approx(expected)
