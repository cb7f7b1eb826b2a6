"""The fully-async policy's ``MetricsAggregator`` (verl 0.9.1), on rlmetrics states.

verl's ``verl.experimental.fully_async_policy.detach_utils.MetricsAggregator`` is the
older copy of the v1 trainer's class: other exact-name rules, "mean"/"avg" keys averaged
without weights, and step-level ratios (throughput, idle ratio, resource utilisation)
computed again from the reduced totals. ``FullyAsyncMetricsAggregator`` takes the same
constructor and calls; its means are weighted by ``sample_count`` (verl's plain mean of
per-iteration means is off whenever iterations hold different numbers of samples), and
it shares the v1 counterpart's additions (states, ``kinds=``, counts summed).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from rlmetrics.compat.verl.aggregator import MetricsAggregator
from rlmetrics.state import TrackerState

_TOOL_CALLS = "timing_s/agent_loop/tool_calls/"
_UTIL = "dynamic_resource/"


class FullyAsyncMetricsAggregator(MetricsAggregator):
    """Reduce a sync cycle's iterations into one step, as verl's fully-async trainer does.

    Args:
        total_gpus: GPUs the throughput is divided by.
        hybrid_gpus: GPUs that switch between rollout and training.
        standalone_gpus: GPUs that only do rollout.
        kinds: ``{key: kind}`` overrides, as for ``MetricsAggregator``.

    Attributes:
        sample_counts: each iteration's ``sample_count``.
        timestamps: each iteration's timestamp.
    """

    _keeps_bools = True  # verl's fully-async class records True/False as 1.0/0.0

    def __init__(
        self,
        total_gpus: int,
        hybrid_gpus: int = 0,
        standalone_gpus: int = 0,
        *,
        kinds: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(kinds=kinds)
        self.total_gpus = total_gpus
        self.hybrid_gpus = hybrid_gpus
        self.standalone_gpus = standalone_gpus
        self.sample_counts: list[int] = []
        self.timestamps: list[float] = []

    @staticmethod
    def _init_aggregation_rules() -> dict[str, list[str]]:
        counts = "fully_async/count/"
        return {
            "time_sum": ["perf/time_per_step"],
            "min": [_TOOL_CALLS + "min"],
            "avg": [_TOOL_CALLS + "mean"],
            "max": [_TOOL_CALLS + "max"],
            "last": [
                *(counts + name for name in _LAST_COUNTS),
                "training/global_step",
                _UTIL + "mq_size",
            ],
            "sum": [_UTIL + "train_compute_time_s", _UTIL + "train_allocated_time_s"],
        }

    def add_step_metrics(  # type: ignore[override]  # verl's signature: count required
        self,
        metrics: Mapping[str, Any] | TrackerState,
        sample_count: int,
        timestamp: float | None = None,
    ) -> None:
        """Record one iteration (see ``MetricsAggregator.add_step_metrics``)."""
        super().add_step_metrics(metrics, sample_count)
        self.sample_counts.append(sample_count)
        self.timestamps.append(time.time() if timestamp is None else timestamp)

    def _kind_from_spelling(self, lower: str) -> str:
        """verl's fully-async order: timings, means, max, min, sums; counts summed."""
        last_part = lower.rsplit("/", 1)[-1]
        if "timing_s/" in lower or last_part == "count" or last_part.endswith("_count"):
            return "sum"
        for keywords, kind in _KEYWORD_KINDS:
            if any(word in lower for word in keywords):
                return kind
        return "mean"

    def get_aggregated_metrics(
        self, rollout_resource_utilization: float | None = None
    ) -> dict[str, Any]:
        """One value per key, plus the cycle's utilisation when it can be computed.

        Args:
            rollout_resource_utilization: the rollouter's utilisation for this cycle; it
                is reported (with the cluster-wide ``resource_utilization``) once the
                training utilisation is known, as in verl.
        """
        out = super().get_aggregated_metrics()
        gpus = self.hybrid_gpus + self.standalone_gpus
        train = out.get(_UTIL + "train_resource_utilization")
        step = out.get("timing_s/step", 0.0)
        if train is None or rollout_resource_utilization is None or gpus <= 0 or step <= 0:
            return out
        rollout = rollout_resource_utilization
        # x: the share of the cycle the hybrid GPUs spent on rollout
        x = min(1.0, max(0.0, out.get("timing_s/wait_for_enough_samples", 0.0) / step))
        hybrid = self.hybrid_gpus
        out[_UTIL + "rollout_resource_utilization"] = rollout
        out[_UTIL + "resource_utilization"] = (
            (1 - x) * hybrid * train + (x * hybrid + self.standalone_gpus) * rollout
        ) / gpus
        return out

    def _recompute_ratios(self, out: dict[str, Any]) -> dict[str, Any]:
        """Ratios of the step's totals: range, throughput, idle ratio, train utilisation."""
        out = super()._recompute_ratios(out)
        tokens, seconds = out.get("perf/total_num_tokens"), out.get("perf/time_per_step")
        if "perf/throughput" in out and tokens is not None and seconds is not None:
            out["perf/throughput"] = tokens / (seconds * self.total_gpus)
        if "timing_s/gen" in out and "timing_s/step" in out:
            out["fully_async/trainer/idle_ratio"] = out["timing_s/gen"] / out["timing_s/step"]
        compute = out.get(_UTIL + "train_compute_time_s")
        allocated = out.get(_UTIL + "train_allocated_time_s", 0.0)
        if compute is not None and allocated > 0:
            out[_UTIL + "train_resource_utilization"] = compute / allocated
        return out

    def reset(self) -> None:
        """Forget every iteration (the next cycle begins)."""
        super().reset()
        self.sample_counts.clear()
        self.timestamps.clear()


_LAST_COUNTS = (
    "total_generated_samples",
    "stale_samples_processed",
    "stale_trajectory_processed",
    "current_param_version",
    "dropped_stale_samples",
)
_KEYWORD_KINDS = (
    (("mean", "avg", "average"), "mean"),
    (("max", "maximum"), "max"),
    (("min", "minimum"), "min"),
    (("sum", "total"), "sum"),
)

__all__ = ["FullyAsyncMetricsAggregator"]
