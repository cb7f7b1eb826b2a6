"""compat.verl.MetricsAggregator against verl 0.9.1's own ``MetricsAggregator``.

The same iterations go to verl's (``verl.trainer.ppo.v1.utils``) and to rlmetrics';
the results agree on every key verl reduces exactly, and differ only where
docs/migrating-from-verl.md ("MetricsAggregator") says they do.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmetrics.compat.verl import FullyAsyncMetricsAggregator, MetricsAggregator
from rlmetrics.compat.verl.aggregator import DAPO_FILTERED_REWARD_COUNTS_KEY

verl_utils = pytest.importorskip("verl.trainer.ppo.v1.utils")
verl_buffer = pytest.importorskip("verl.trainer.ppo.v1.replay_buffer")

# one key per rule verl's heuristics tell apart (weighted mean, max, min, sum, time sum,
# last, evicted counts and their staleness, the seqlen range)
KEYS = [
    "actor/pg_loss/mean",
    "actor/kl",
    "critic/score/max",
    "critic/score/min",
    "response/terminated_ratio",
    "timing_s/gen",
    "timing_per_token_ms/adv",
    "perf/total_num_tokens",
    "training/off_policy/evicted_samples",
    "training/off_policy/evicted_samples_staleness/mean",
    "training/global_step",
    "actor/lr",
    "global_seqlen/min",
    "global_seqlen/max",
    "global_seqlen/minmax_diff",
]
WRAPS = [float, np.float32, np.float64, torch.tensor]


def _value(draw: st.DrawFn, key: str) -> object:
    if key == "training/off_policy/evicted_samples":  # a count (it weighs the staleness)
        return draw(st.integers(0, 9))
    number = draw(st.floats(-1e3, 1e3, allow_nan=False, width=32))
    return draw(st.sampled_from(WRAPS))(number)


@st.composite
def iterations(draw: st.DrawFn) -> list[tuple[dict, int]]:
    """A few iterations, each with some of KEYS and a sample count (0 = none given)."""
    out = []
    for _ in range(draw(st.integers(1, 5))):
        keys = draw(st.lists(st.sampled_from(KEYS), unique=True))
        out.append(({key: _value(draw, key) for key in keys}, draw(st.integers(0, 6))))
    return out


def both(steps: list[tuple[dict, int]], **kwargs) -> tuple[dict, dict]:
    """(verl's result, rlmetrics' result) for the same iterations."""
    theirs, ours = verl_utils.MetricsAggregator(), MetricsAggregator(**kwargs)
    for metrics, count in steps:
        theirs.add_step_metrics(metrics, sample_count=count)
        ours.add_step_metrics(metrics, sample_count=count)
    return theirs.get_aggregated_metrics(), ours.get_aggregated_metrics()


@settings(max_examples=150, deadline=None)
@given(steps=iterations())
def test_agrees_with_verl_on_every_exact_rule(steps):
    theirs, ours = both(steps)
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, rel=1e-12, abs=1e-9), key


def test_the_dapo_key_is_verls():
    assert verl_buffer.DAPO_FILTERED_REWARD_COUNTS_KEY == DAPO_FILTERED_REWARD_COUNTS_KEY
    key = DAPO_FILTERED_REWARD_COUNTS_KEY
    theirs, ours = both([({key: {0.0: 2, 1.0: 1}}, 4), ({key: {1.0: 5}}, 4)])
    assert ours == theirs == {key: {0.0: 2, 1.0: 6}}


def test_counts_sum_where_verl_averages():
    key = "training/rollout_logprobs_mismatch_count"
    theirs, ours = both([({key: 1}, 0), ({key: 4}, 0)])
    assert theirs[key] == pytest.approx(2.5)  # verl 0.9.1: the mean of the counts
    assert ours[key] == 5.0


def test_one_element_arrays_count_where_verl_drops_them():
    theirs, ours = both([({"x/mean": np.array([2.0]), "y/mean": 1.0}, 1)])
    assert theirs == {"y/mean": 1.0}
    assert ours == {"x/mean": 2.0, "y/mean": 1.0}


def test_kinds_replace_verls_spelling_rule():
    key = "response/terminated_ratio"  # "min" inside "terminated"
    steps = [({key: 0.2}, 1), ({key: 0.6}, 3)]
    theirs, ours = both(steps, kinds={key: "mean"})
    assert theirs[key] == 0.2
    assert ours[key] == pytest.approx(0.5)


# -- the fully-async policy's copy ---------------------------------------------------
detach_utils = pytest.importorskip("verl.experimental.fully_async_policy.detach_utils")

ASYNC_KEYS = [
    "actor/kl/mean",
    "reward/avg",
    "actor/entropy",
    "critic/score/max",
    "critic/score/min",
    "perf/throughput",
    "perf/total_num_tokens",
    "perf/time_per_step",
    "timing_s/gen",
    "timing_s/step",
    "timing_s/wait_for_enough_samples",
    "timing_s/agent_loop/tool_calls/mean",
    "fully_async/count/current_param_version",
    "dynamic_resource/mq_size",
    "dynamic_resource/train_compute_time_s",
    "dynamic_resource/train_allocated_time_s",
    "training/global_step",
    "done",
]


@st.composite
def async_cycles(draw: st.DrawFn) -> tuple[list[tuple[dict, int]], float | None]:
    """Iterations with one sample count for all (where verl's plain mean is exact)."""
    count = draw(st.integers(0, 6))
    steps = []
    for _ in range(draw(st.integers(1, 5))):
        keys = draw(st.lists(st.sampled_from(ASYNC_KEYS), unique=True))
        metrics = {}
        for key in keys:
            number = draw(st.floats(0.5, 1e3, width=32))  # times and totals: positive
            metrics[key] = (
                draw(st.booleans()) if key == "done" else draw(st.sampled_from(WRAPS))(number)
            )
        steps.append((metrics, count))
    return steps, draw(st.none() | st.floats(0.0, 1.0))


def both_async(steps, rollout_util, gpus=(8, 2, 6)) -> tuple[dict, dict]:
    """(verl's result, rlmetrics' result) for the same fully-async cycle."""
    theirs = detach_utils.MetricsAggregator(*gpus)
    ours = FullyAsyncMetricsAggregator(*gpus)
    for metrics, count in steps:
        theirs.add_step_metrics(metrics, count, timestamp=1.0)
        ours.add_step_metrics(metrics, count, timestamp=1.0)
    return theirs.get_aggregated_metrics(rollout_util), ours.get_aggregated_metrics(rollout_util)


@settings(max_examples=150, deadline=None)
@given(cycle=async_cycles())
def test_fully_async_agrees_with_verl_at_equal_sample_counts(cycle):
    theirs, ours = both_async(*cycle)
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, rel=1e-12, abs=1e-9), key


def test_fully_async_means_are_weighted_where_verl_averages():
    theirs, ours = both_async([({"actor/kl/mean": 1.0}, 1), ({"actor/kl/mean": 3.0}, 3)], None)
    assert theirs["actor/kl/mean"] == 2.0
    assert ours["actor/kl/mean"] == pytest.approx(2.5)
