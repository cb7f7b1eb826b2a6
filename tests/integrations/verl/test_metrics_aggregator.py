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

from rlmetrics.compat.verl import MetricsAggregator
from rlmetrics.compat.verl_aggregator import DAPO_FILTERED_REWARD_COUNTS_KEY

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
