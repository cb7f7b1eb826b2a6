"""``ExactTrainingWorker``: verl's TrainingWorker, reporting exact update metrics.

The update itself is verl's, untouched: same loss, same gradients, same optimizer
steps. What changes is the metrics dict ``train_mini_batch`` returns:

* every micro-batch's ``ppo_loss`` / ``value_loss`` metrics are also logged into a
  Tracker with the weight they stand for (``rlmetrics.integrations.verl.losses``);
* each optimizer step logs ``grad_norm`` (a mean over the step's optimizer steps) and
  ``lr`` as the value in the optimizer when it stepped (verl reports the scheduler's
  value *after* stepping, the next step's);
* at the end of ``train_mini_batch`` every data-parallel rank merges the Tracker over
  verl's data-parallel group (one packed collective) and the merged values replace
  verl's under verl's own names, so the driver's ``reduce_metrics`` logs them as they
  are.

Names this module does not produce keep verl's value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from verl.single_controller.base.decorator import MAGIC_ATTR
from verl.utils import tensordict_utils as tu
from verl.workers.engine_workers import TrainingWorker
from verl.workers.utils.losses import ppo_loss, value_loss

from rlmetrics.integrations.verl.losses import RecordingLoss
from rlmetrics.tracker import Tracker

RECORDED_LOSSES = (ppo_loss, value_loss)
"""The loss functions whose metrics are made exact (others pass through unchanged)."""


def _same_dispatch(parent: Any) -> Callable[[Any], Any]:
    """Give an override the parent's verl dispatch registration (``@register``)."""

    def decorate(method: Any) -> Any:
        setattr(method, MAGIC_ATTR, dict(getattr(parent, MAGIC_ATTR)))
        return method

    return decorate


def optimizer_lr(engine: Any) -> float | None:
    """The learning rate the engine's next optimizer step will use (first param group)."""
    optimizer = getattr(engine, "optimizer", None)
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return None
    return float(groups[0]["lr"])


class ExactTrainingWorker(TrainingWorker):
    """verl's ``TrainingWorker`` whose update metrics are partition invariant.

    Registered by ``rlmetrics.integrations.verl.enable()`` as the actor's worker class
    (``ActorRolloutRefWorker.actor_worker_cls``) and as the critic's.
    """

    @property
    def metrics_tracker(self) -> Tracker:
        """This worker's step tracker (made on first use)."""
        tracker = self.__dict__.get("_rlmetrics_tracker")
        if tracker is None:
            tracker = self.__dict__["_rlmetrics_tracker"] = Tracker()
        return tracker

    @_same_dispatch(TrainingWorker.set_loss_fn)
    def set_loss_fn(self, loss_fn: Any) -> None:
        if getattr(loss_fn, "func", None) in RECORDED_LOSSES:
            loss_fn = RecordingLoss(loss_fn, self.metrics_tracker)
        super().set_loss_fn(loss_fn)

    @_same_dispatch(TrainingWorker.train_batch)
    def train_batch(self, data: Any) -> Any:
        lr = optimizer_lr(self.engine)
        output = super().train_batch(data)
        if not isinstance(self.loss_fn, RecordingLoss):
            return output
        tracker = self.metrics_tracker
        if lr is not None:
            tracker.last("lr", lr)
        if output is not None:
            grad_norm = tu.get(output, "metrics").get("grad_norm")
            if grad_norm is not None:
                tracker.mean("grad_norm", float(grad_norm))
        return output

    @_same_dispatch(TrainingWorker.train_mini_batch)
    def train_mini_batch(self, data: Any) -> Any:
        tracker = self.metrics_tracker
        tracker.reset()
        output = super().train_mini_batch(data)
        if not isinstance(self.loss_fn, RecordingLoss):
            return output
        group = self.engine.get_data_parallel_group()
        sync = group is not None and torch.distributed.is_initialized()
        exact = tracker.compute(group=group, sync=sync)
        if output is None:
            return None
        metrics = dict(tu.get(output, "metrics"))
        for name, value in exact.items():
            metrics[name] = [value]
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics}).cpu()
