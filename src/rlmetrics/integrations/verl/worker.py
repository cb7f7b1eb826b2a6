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
  are; serving a V1 trainer, it also returns the merged state they came from
  (``async_steps.STATE_KEY``), which the V1 step merges over its iterations.

Names this module does not produce keep verl's value. With ``RLMETRICS_VERL_DETAIL=1``
(``rlmetrics.integrations.verl.detail``) it also logs each rank's time in the engine's
train steps (``<role>/update_time_s``, the slowest rank's and which) and replaces verl's
``mfu`` with the step's global FLOPs over that slowest time.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from verl.single_controller.base.decorator import MAGIC_ATTR
from verl.utils import tensordict_utils as tu
from verl.utils.metric.utils import Metric
from verl.workers.engine_workers import TrainingWorker
from verl.workers.utils.losses import ppo_loss, value_loss

from rlmetrics.integrations.verl import _switch_when_defined, detail
from rlmetrics.integrations.verl.async_steps import STATE_KEY
from rlmetrics.integrations.verl.losses import AGG_LOSSES, TOKEN_MEANS, RecordingLoss
from rlmetrics.state import TrackerState
from rlmetrics.tracker import Tracker

RECORDED_LOSSES = (ppo_loss, value_loss)
"""The loss functions whose metrics are made exact (others pass through unchanged)."""


def _same_dispatch(parent: Any) -> Callable[[Any], Any]:
    """Give an override the parent's verl dispatch registration (``@register``)."""

    def decorate(method: Any) -> Any:
        setattr(method, MAGIC_ATTR, dict(getattr(parent, MAGIC_ATTR)))
        return method

    return decorate


def verl_train_time() -> float:
    """The seconds verl's ``Timer(name="train_batch")`` has accumulated in this process
    (codetiming's class-wide totals): the difference around one ``train_batch`` call is
    the ``delta_time`` verl's MFU uses, the engine's train step alone."""
    from codetiming import Timer

    return float(Timer.timers.get("train_batch", 0.0))


def optimizer_lr(engine: Any) -> float | None:
    """The learning rate the engine's next optimizer step will use (first param group)."""
    optimizer = getattr(engine, "optimizer", None)
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return None
    return float(groups[0]["lr"])


class StepState(Metric):
    """An update's merged state among its metrics (``async_steps.STATE_KEY``): verl's
    ``reduce_metrics`` calls ``aggregate()`` on a ``Metric`` and keeps what it returns,
    here the state, for the V1 trainer's ``StepMetricsAggregator`` to merge."""

    def __init__(self, state: TrackerState) -> None:
        super().__init__("mean")
        self.state = state

    def aggregate(self) -> TrackerState:
        return self.state


def serves_v1_trainer() -> bool:
    """Whether this worker process serves a V1 trainer: verl's TransferQueue bridge has
    fetched a batch here (``transferqueue_utils.TQ_INITIALIZED``; the V0 trainer sends
    its batches itself and never sets it). The V1 actor's ``update_actor`` hands its
    inner worker the fetched ``TensorDict``, so the worker's own input cannot tell."""
    bridge = sys.modules.get("verl.utils.transferqueue_utils")
    return bool(getattr(bridge, "TQ_INITIALIZED", False))


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
        timed = isinstance(self.loss_fn, RecordingLoss) and detail.enabled()
        if timed:
            started = verl_train_time()
            tokens = tu.get(data, key="global_token_num", default=None)
            images = tu.get(data, key="images_seqlens", default=None)
        output = super().train_batch(data)
        if not isinstance(self.loss_fn, RecordingLoss):
            return output
        tracker = self.metrics_tracker
        if timed:
            self._log_update_time(verl_train_time() - started, tokens, images)
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
        self.__dict__["_rlmetrics_step_tokens"] = []
        output = super().train_mini_batch(data)
        if not isinstance(self.loss_fn, RecordingLoss):
            return output
        group = self.engine.get_data_parallel_group()
        sync = group is not None and torch.distributed.is_initialized()
        per_source = self._declare_sources() if detail.enabled() else ()
        state = tracker.compute_state(group=group, sync=sync)
        exact = state.compute(empty=tracker.empty)
        if per_source:
            self._known_sources().update(detail.reported_sources(exact, per_source))
        if output is None:
            return None
        metrics = dict(tu.get(output, "metrics"))
        for name, value in exact.items():
            metrics[name] = [value]
        if serves_v1_trainer():  # the V1 step merges its iterations' states
            metrics[STATE_KEY] = StepState(state)
        mfu = self._step_mfu(exact)
        if mfu is not None:
            metrics["mfu"] = [mfu]
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics}).cpu()

    def _known_sources(self) -> set[str]:
        """The data sources earlier updates of this worker reported (the same set on
        every rank)."""
        return self.__dict__.setdefault("_rlmetrics_sources", set())

    def _declare_sources(self) -> list[str]:
        """Name every known source's metrics (``detail.declare_sources``): those of
        ``RLMETRICS_VERL_SOURCES`` and those earlier updates reported. Returns the
        names that have a value per source (this update's loss metrics)."""
        tracker = self.metrics_tracker
        names = [name for name in tracker.schema() if name in TOKEN_MEANS or name in AGG_LOSSES]
        detail.declare_sources(tracker, names, self._known_sources() | detail.configured_sources())
        return names

    def _update_time_name(self) -> str:
        """``<role>/update_time_s``: the role from the loss (``ppo_loss``: actor)."""
        loss = self.loss_fn
        role = "actor" if isinstance(loss, RecordingLoss) and loss.is_policy_loss else "critic"
        return f"{role}/{detail.UPDATE_TIME}"

    def _log_update_time(self, seconds: float, tokens: Any, images: Any) -> None:
        """Log this rank's time in one engine ``train_batch`` (verl's own timer, the time
        verl's MFU divides by) as a rank-time metric, and keep the mini-batch's global
        token counts for the step's MFU (None: verl's MFU stays, as for image inputs)."""
        group = self.engine.get_data_parallel_group()
        where = {"group": group} if group is not None and torch.distributed.is_initialized() else {}
        self.metrics_tracker.elapsed(self._update_time_name(), seconds, **where)
        step_tokens = self.__dict__.setdefault("_rlmetrics_step_tokens", [])
        if step_tokens is None or tokens is None or images is not None:
            self.__dict__["_rlmetrics_step_tokens"] = None
        else:
            step_tokens.extend(tokens)

    def _step_mfu(self, exact: dict[str, float]) -> float | None:
        """The step's MFU: verl's FLOPs estimate for every sequence of the step (the
        global token counts of all its mini-batches) over the slowest rank's time, per
        device; None when the switch is off or a count is missing (verl's value stays)."""
        tokens = self.__dict__.get("_rlmetrics_step_tokens")
        seconds = exact.get(self._update_time_name())
        counter = getattr(self, "flops_counter", None)
        if not tokens or not seconds or counter is None:
            return None
        achieved, promised = counter.estimate_flops(tokens, seconds)
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        return float(achieved / promised / world)


# Imported before verl's workers module (directly, or by an unpickled class), this module
# imported that module above, whose loading asked for the switch before the class existed.
_switch_when_defined()
