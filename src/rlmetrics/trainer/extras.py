"""The reference trainer's opt-in metrics (``MetricsConfig``): the integrations' switches.

The same three extras as verl's ``RLMETRICS_VERL_DETAIL`` and TRL's ``ExtraMetrics``,
under verl's names, all logged into the step's tracker and so carried by its one
``compute()``:

* **per data source** (``per_source``): every update metric again over one data
  source's rows, as ``<key>/<source>``. The loss helpers run a second time on the
  micro-batch's forward pass (no gradient) with the response mask restricted to the
  source's rows and the mini-batch's global counts of that source, so each value is what
  the whole-batch metric would read if the step held only that source's sequences. The
  per-source counts ride in the mini-batch's counts all_reduce: no collective is added;
* **token quantiles** (``token_quantiles``): every update token's entropy, importance
  ratio and KL into quantile sketches (``actor/token_entropy``,
  ``actor/importance_ratio``, ``actor/token_kl``);
* **update timing** (``update_timing``): each rank's update time as a rank-time metric
  (``<learner>/update_time_s``: the slowest rank's, with which rank), and
  ``perf/mfu/<learner>`` as the whole step's FLOPs over that slowest time, worked out
  by ``finish`` after the sync from a sum logged beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from rlmetrics import rl
from rlmetrics.distributed import all_reduce_sum, world_size
from rlmetrics.rl.counts import local_counts
from rlmetrics.rl.policy import clamped_log_ratio
from rlmetrics.rl.updates import masked
from rlmetrics.trainer.task import SOURCES

NAIVE = ("actor/pg_clipfrac", "actor/ppo_kl")
"""The token means that ``naive`` reports again, naively, as ``naive/<name>``."""

UPDATE_TIME = "update_time_s"
"""The rank-time metric of a learner's update, under its name: ``actor/update_time_s``."""

TOKEN_QUANTILES = {
    "entropy": "actor/token_entropy",
    "ratio": "actor/importance_ratio",
    "kl": "actor/token_kl",
}
"""The per-token distributions the actor reports (verl's names; keys ``name/p50`` ...)."""

IDEAL_SECONDS = "perf/_ideal_seconds/"
"""Hidden sum (popped by ``finish``): the step's FLOPs of a learner over the ranks' peak
FLOP/s, i.e. the update's time at 100% MFU on every rank."""


@dataclass(frozen=True)
class SourceCounts:
    """A mini-batch's global counts per data source, and the sources one micro-batch holds.

    Attributes:
        counts: per source id (an index into ``task.SOURCES``), the mini-batch's counts
            of that source's rows over every rank.
        present: the source ids with a row in the micro-batch at hand (host).
    """

    counts: Mapping[int, rl.BatchCounts]
    present: tuple[int, ...] = ()

    def present_in(self, source_ids: Tensor) -> SourceCounts:
        """These counts, for a micro-batch whose rows come from ``source_ids`` (CPU)."""
        return replace(self, present=tuple(sorted(set(source_ids.tolist()))))


def global_source_counts(
    mask: Tensor, source_ids: Tensor, group: Any = None
) -> tuple[rl.BatchCounts, SourceCounts]:
    """``rl.global_counts(mask, group)`` and each data source's counts, in one all_reduce.

    Args:
        mask: this rank's response mask for the mini-batch, (B, T).
        source_ids: each row's source id (``Task.sources``), (B,).
    """
    rows = source_ids.to(mask.device)
    parts = [mask] + [mask & (rows == s)[:, None] for s in range(len(SOURCES))]
    counts = all_reduce_sum(torch.cat([local_counts(m) for m in parts]), group)
    scale = float(world_size(group))
    whole = rl.BatchCounts(counts[0], counts[1], scale)
    by_source = {
        s: rl.BatchCounts(counts[2 + 2 * s], counts[3 + 2 * s], scale) for s in range(len(SOURCES))
    }
    return whole, SourceCounts(by_source)


def per_source(
    sources: SourceCounts,
    mb: Mapping[str, Tensor],
    mask: Tensor,
    evaluate: Callable[[Tensor, rl.BatchCounts], list[rl.MetricUpdate]],
) -> list[rl.MetricUpdate]:
    """``evaluate(mask of one source's rows, that source's counts)`` for each source in
    the micro-batch, its updates renamed ``<name>/<source>``. Run it without gradient."""
    out = []
    for s in sources.present:
        part = mask & (mb["source"] == s)[:, None]
        for u in evaluate(part, sources.counts[s]):
            out.append(rl.MetricUpdate(f"{u.name}/{SOURCES[s]}", u.kind, u.value, u.weight))
    return out


def token_quantiles(
    logp: Tensor,
    old_logp: Tensor,
    entropy: Tensor,
    mask: Tensor,
    ref_logp: Tensor | None,
    kl_type: str,
) -> list[rl.MetricUpdate]:
    """Quantile sketches of the micro-batch's response tokens: entropy, importance ratio
    (log-ratio clamped to ±20, as the loss), and the KL of ``kl_type`` when there is a
    reference."""
    with torch.no_grad():
        ratio = torch.exp(clamped_log_ratio(logp, old_logp))
        values = {"entropy": entropy, "ratio": ratio}
        if ref_logp is not None:
            values["kl"] = rl.kl_estimate(logp, ref_logp, kl_type)
        return [
            rl.MetricUpdate(TOKEN_QUANTILES[k], "quantile", masked(v.detach(), mask), mask)
            for k, v in values.items()
        ]


def ideal_seconds(learner: str, flops: float, peak_flops: float, ranks: int) -> rl.MetricUpdate:
    """This rank's share of the hidden sum that ``finish`` divides by the slowest time:
    its FLOPs over the peak of all ``ranks``."""
    return rl.MetricUpdate(IDEAL_SECONDS + learner, "sum", flops / peak_flops / ranks)


def finish(metrics: dict[str, float]) -> dict[str, float]:
    """After the sync: ``perf/mfu/<learner>`` = the step's FLOPs / (the slowest rank's
    update time × the ranks' peak), from the hidden sums, which are removed. The same
    numbers on every rank (and on a driver that merged the ranks' states)."""
    for key in [k for k in metrics if k.startswith(IDEAL_SECONDS)]:
        learner = key[len(IDEAL_SECONDS) :]
        ideal = metrics.pop(key)
        slowest = metrics.get(f"{learner}/{UPDATE_TIME}")
        if slowest is not None:
            metrics[f"perf/mfu/{learner}"] = ideal / max(slowest, 1e-12)
    return metrics


def naive_means(updates: list[rl.MetricUpdate]) -> list[rl.MetricUpdate]:
    """``naive/<name>`` for each token mean of ``NAIVE`` in one micro-batch's updates.

    Each is the micro-batch's own mean, logged with weight 1 (0 for a micro-batch with
    no token). The tracker averages them over every micro-batch of every rank: the mean
    of micro-batch means that a framework logging a float per micro-batch reports (verl's
    too, when ranks have as many micro-batches). It changes with the partition, by
    design: the demo prints it next to the exact value.
    """
    out = []
    for update in updates:
        if update.name in NAIVE:
            tokens = update.weight.sum()
            own_mean = update.value.sum() / tokens.clamp(min=1)
            out.append(
                rl.MetricUpdate(f"naive/{update.name}", "mean", own_mean, (tokens > 0).double())
            )
    return out
