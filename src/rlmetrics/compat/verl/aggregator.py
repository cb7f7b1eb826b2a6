"""verl's ``MetricsAggregator`` (``verl.trainer.ppo.v1.utils``), on rlmetrics states.

verl's asynchronous trainers run several local updates per logged step and reduce the
per-iteration metric dicts into one with a rule picked from each key's spelling
(sum, max, min, last, or a mean weighted by the iteration's ``sample_count``). This
class takes the same calls and gives the same results for plain numbers, built on a
``Tracker``: a rule becomes a kind, so counts sum, means are weighted by what each
value stands for, and the ``last`` value is the latest one.

What is added (see docs/migrating-from-verl.md, "MetricsAggregator"):

* an iteration may hand in rlmetrics states (a ``TrackerState``, a ``MetricState`` or
  a ``compat.verl.Metric`` under a key): they merge by their own kind, so a token-level
  mean stays exact however the iterations were split, and no key heuristic is used;
* ``kinds={key: kind}`` fixes a key's kind where the spelling misleads (verl's
  substring rules read "terminated" as "min");
* keys whose last path part is ``count`` or ends in ``_count`` are summed (verl 0.9.1
  averages them);
* iterations merge in time order (a ``rlmetrics.Window``): a ``last`` state of a later
  iteration replaces an earlier one's, as a later number does.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from rlmetrics.compat.verl.metric import Metric
from rlmetrics.kinds import MetricState
from rlmetrics.state import TrackerState
from rlmetrics.tracker import Tracker
from rlmetrics.window import Window

DAPO_FILTERED_REWARD_COUNTS_KEY = "_dapo_filtered_reward_counts"
"""verl's key for DAPO's ``{reward value: count}`` breakdown (a dict, counts add up)."""

# verl's aggregation type -> the rlmetrics kind that reduces it
_KIND_OF_RULE = {
    "last": "last",
    "sum": "sum",
    "time_sum": "sum",
    "max": "max",
    "min": "min",
    "weighted_avg": "mean",
    "avg": "mean",  # the fully-async class's plain mean: weighted here too
}
_KINDS = frozenset(_KIND_OF_RULE.values())


def _scalar(value: Any, bools: bool = False) -> float | None:
    """A loggable number (bools only if ``bools``), or None for what verl skips silently."""
    if isinstance(value, bool | np.bool_):
        return float(value) if bools else None
    if isinstance(value, int | float | np.number):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, np.ndarray) and value.size == 1:
        return float(value.item())
    return None


class MetricsAggregator:
    """Reduce several iterations' metric dicts into one step's, as verl does, exactly.

    Args:
        kinds: ``{key: kind}`` ("mean", "sum", "min", "max" or "last") for keys whose
            spelling would pick the wrong rule; those keys skip the heuristics.

    Attributes:
        step_count: iterations added since the last ``reset()``.
        aggregation_rules: verl's exact-name rules, ``{"sum": [...], "last": [...]}``;
            edit it before adding metrics, as in verl.

    Examples:
        >>> agg = MetricsAggregator()
        >>> agg.add_step_metrics({"actor/pg_loss/mean": 1.0}, sample_count=1)
        >>> agg.add_step_metrics({"actor/pg_loss/mean": 3.0}, sample_count=3)
        >>> agg.get_aggregated_metrics()
        {'actor/pg_loss/mean': 2.5}
    """

    _keeps_bools = False  # verl's v1 class skips bools; the fully-async one records them

    def __init__(self, *, kinds: Mapping[str, str] | None = None) -> None:
        kinds = dict(kinds or {})
        for key, kind in kinds.items():
            if kind not in _KINDS:
                raise ValueError(
                    f"MetricsAggregator(kinds=...): metric {key!r} has kind {kind!r}; "
                    f"expected one of {sorted(_KINDS)}"
                )
        self.kinds = kinds
        self.step_count = 0
        self.aggregation_rules = self._init_aggregation_rules()
        self._tracker = Tracker()  # one iteration's metrics
        # the iterations so far, in time order: a ``last`` state of a later iteration
        # replaces an earlier one (a plain state merge would average them, as ranks)
        self._window = Window(self._tracker, every=None, sync=False)
        self._unweighted = Tracker()  # verl's fallback when a mean's weights sum to 0
        self.dict_metrics: dict[str, Counter] = {}

    @staticmethod
    def _init_aggregation_rules() -> dict[str, list[str]]:
        evicted = ("off_policy", "filter_groups", "rollout_failure")
        sums = [f"{split}/{group}/evicted_samples" for group in evicted for split in _SPLITS]
        sums += [f"{split}/filter_groups/discarded_surplus_samples" for split in _SPLITS]
        return {"sum": sums, "last": ["training/global_step", "training/rollout_probs_diff_valid"]}

    def add_step_metrics(
        self, metrics: Mapping[str, Any] | TrackerState, sample_count: int = 0
    ) -> None:
        """Record one iteration's metrics.

        Numbers (python, numpy, one-element tensors or arrays) are reduced by their key's
        rule; a mean is weighted by ``sample_count`` (verl's weight). A ``TrackerState``,
        or a ``MetricState`` or ``compat.verl.Metric`` under a key, merges by its kind.
        Bools, strings, None and multi-element tensors are skipped, as in verl.

        Raises:
            ValueError: ``sample_count`` is negative or not finite, or a key receives
                values of two kinds (say a "max" number, then a mean state); the
                iteration is dropped.
        """
        if not isinstance(sample_count, int | float | np.number) or not (
            math.isfinite(sample_count) and sample_count >= 0
        ):
            raise ValueError(f"sample_count must be a finite number >= 0, got {sample_count!r}")
        try:
            if isinstance(metrics, TrackerState):
                self._tracker.merge(metrics)
            else:
                for key, value in metrics.items():
                    self._add(key, value, metrics, sample_count)
            self._check_kinds()
            self._window.step()
        except BaseException:
            self._tracker.reset()  # the failed iteration is dropped
            raise
        self.step_count += 1

    def _check_kinds(self) -> None:
        """Raise when a key of this iteration has another kind than in an earlier one
        (the window would take the iteration without it and raise at the report)."""
        earlier = self._window.state().metrics
        for key, kind in self._tracker.schema().items():
            seen = earlier.get(key)
            if seen is not None and seen.kind != kind:
                raise ValueError(
                    f"metric {key!r} is kind {kind!r} in this iteration but {seen.kind!r} "
                    "in an earlier one; a key keeps one kind until reset()"
                )

    def _add(self, key: str, value: Any, metrics: Mapping[str, Any], sample_count: int) -> None:
        if key == DAPO_FILTERED_REWARD_COUNTS_KEY and isinstance(value, Mapping):
            self.dict_metrics.setdefault(key, Counter()).update(value)
            return
        if isinstance(value, Metric):
            value = value.to_state()
        if isinstance(value, MetricState):
            self._tracker.merge(TrackerState({key: value}))
            return
        number = _scalar(value, self._keeps_bools)
        if number is None:
            return
        kind = self._kind(key)
        if kind == "mean":
            weight = self._weight(key, metrics, sample_count)
            self._tracker.mean(key, number, weight=weight)
            self._unweighted.mean(key, number)
        else:
            self._tracker.log(key, number, kind=kind)

    def _weight(self, key: str, metrics: Mapping[str, Any], sample_count: int) -> float:
        """The sample count, except for evicted-sample staleness: the evicted count."""
        suffix = "_staleness/mean"
        if key.endswith("/off_policy/evicted_samples" + suffix):
            evicted = _scalar(metrics.get(key[: -len(suffix)]))
            if evicted is not None:
                return float(int(evicted))  # verl truncates the count to an int
        return float(sample_count)

    def _kind(self, key: str) -> str:
        """The rlmetrics kind for ``key``: ``kinds``, then verl's rules, then counts."""
        if key in self.kinds:
            return self.kinds[key]
        for rule, names in self.aggregation_rules.items():
            if key in names:
                return _KIND_OF_RULE[rule]
        return self._kind_from_spelling(key.lower())

    def _kind_from_spelling(self, lower: str) -> str:
        """verl's substring rules (v1 trainer's order), plus counts summed."""
        last_part = lower.rsplit("/", 1)[-1]
        if lower.endswith(("/lr", "_lr")) or lower == "lr":
            return "last"
        if "timing_s/" in lower or "timing_per_token_ms/" in lower:
            return "sum"
        if last_part == "count" or last_part.endswith("_count"):
            return "sum"
        for keywords, kind in _KEYWORD_KINDS:
            if any(word in lower for word in keywords):
                return kind
        return "mean"

    def get_aggregated_metrics(self) -> dict[str, Any]:
        """One value per key over the iterations added (``{}`` before the first)."""
        if self.step_count == 0:
            return {}
        out: dict[str, Any] = self._window.flush(reset=False)
        fallback = self._unweighted.compute(reset=False, sync=False)
        for key, value in fallback.items():
            out.setdefault(key, value)  # every weight was 0: verl's plain mean
        for key, counter in self.dict_metrics.items():
            if counter:
                out[key] = dict(counter)
        return self._recompute_ratios(out)

    def _recompute_ratios(self, out: dict[str, Any]) -> dict[str, Any]:
        """Metrics derived from others, computed again from the step's values."""
        diff, high, low = "global_seqlen/minmax_diff", "global_seqlen/max", "global_seqlen/min"
        if diff in out and high in out and low in out:
            out[diff] = out[high] - out[low]  # the step's range, not a max of ranges
        return out

    def state(self) -> TrackerState:
        """The weighted metrics as a mergeable state (plain-mean fallbacks not included)."""
        return self._window.state()

    def reset(self) -> None:
        """Forget every iteration (the next step begins)."""
        self._window.reset()
        self._tracker.reset()
        self._unweighted.reset()
        self.dict_metrics.clear()
        self.step_count = 0


_SPLITS = ("training", "validation")
_KEYWORD_KINDS = (
    (("max", "maximum"), "max"),
    (("min", "minimum"), "min"),
    (("sum", "total"), "sum"),
)

__all__ = ["DAPO_FILTERED_REWARD_COUNTS_KEY", "MetricsAggregator"]
