"""The result of a loss helper."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from rlmetrics.rl.updates import MetricUpdate


@dataclass(frozen=True, slots=True)
class LossOutput:
    """A micro-batch's loss and its metric updates.

    Attributes:
        loss: the loss for ``backward()`` only (scaled by global counts and
            ``grad_scale``); never log it, log ``updates``.
        updates: the metric updates (``log_updates(tracker, out.updates)``).
    """

    loss: Tensor
    updates: list[MetricUpdate] = field(default_factory=list)
