"""SkyRL's FSDP policy and critic workers, reporting exact update metrics.

The update itself is SkyRL's, untouched: same loss, same gradients, same optimizer
steps. What changes is the metrics dict ``forward_backward`` returns, and what the
worker keeps for the trainer:

* every micro-batch's metrics are also logged into a Tracker with the weight they stand
  for (``rlmetrics.integrations.skyrl.micro_batch``), and each sequence's response
  length;
* at the end of ``forward_backward`` (one mini-batch) the data-parallel ranks merge that
  Tracker in one packed collective, and the merged values replace SkyRL's under SkyRL's
  own names (the losses keep SkyRL's value: it is already the mini-batch's);
* the worker also keeps the step's state: every mini-batch's, the losses weighted by
  this rank's tokens (or sequences), and per optimizer step ``grad_norm`` and the
  learning rate the step applied. ``ExactRayPPOTrainer`` takes it from every worker
  once per training step (``take_step_metrics_state``) and merges it on the driver,
  where SkyRL's trainer would average the mini-batches' dicts again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ray
import torch
from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import (
    FSDPCriticWorkerBase,
    FSDPPolicyWorkerBase,
)

from rlmetrics.integrations.skyrl.micro_batch import (
    CRITIC_SEQUENCE_MEANS,
    CRITIC_TOKEN_MEANS,
    POLICY_SEQUENCE_MEANS,
    POLICY_TOKEN_MEANS,
    log_micro_batch,
    log_response_lengths,
)
from rlmetrics.state import TrackerState
from rlmetrics.tracker import Tracker

POLICY_LOSSES = ("policy_loss", "final_loss")
"""The policy's losses: SkyRL sums the micro-batches' pre-scaled shares, so its value is
already the mini-batch's; across mini-batches they are weighted by the loss's count."""

GRAD_NORM = "grad_norm"
"""The step's mean gradient norm over its optimizer steps (SkyRL's trainer's key)."""


def optimizer_lr(optimizer: Any) -> float | None:
    """The learning rate the optimizer's next step applies (first param group)."""
    groups = getattr(optimizer, "param_groups", None)
    return float(groups[0]["lr"]) if groups else None


class StepMetrics:
    """A worker's two Trackers: the mini-batch's, merged over the data-parallel group
    at its end; and the step's, every mini-batch and optimizer step since the trainer
    last took it (merged across workers on the driver)."""

    def __init__(self) -> None:
        self.mini_batch = Tracker()
        self.step = Tracker()
        self._counts: list[torch.Tensor] = []

    def start(self) -> None:
        """A new mini-batch begins."""
        self.mini_batch.reset()
        self._counts = []

    def log_micro_batch(
        self,
        status: dict[str, Any],
        experience: Any,
        token_means: frozenset[str],
        sequence_means: frozenset[str],
    ) -> None:
        """Log one micro-batch (``micro_batch.log_micro_batch``); keep its counts."""
        counts = log_micro_batch(
            self.mini_batch,
            status,
            experience,
            token_means=token_means,
            sequence_means=sequence_means,
        )
        self._counts = (
            [a + b for a, b in zip(self._counts, counts, strict=True)]
            if self._counts
            else [*counts]
        )

    def finish(
        self, metrics: dict[str, Any], group: Any, losses: tuple[str, ...], by_tokens: bool
    ) -> dict[str, Any]:
        """End the mini-batch: SkyRL's ``metrics`` with every name this worker logged
        replaced by its value over the data-parallel group (one packed collective).

        ``losses`` keep SkyRL's value; the step logs each with this rank's loss tokens
        (``by_tokens``) or sequences as its weight, so that the step's value is the
        loss's mean over every mini-batch's tokens (or sequences).
        """
        self.step.merge(self.mini_batch.state())
        if self._counts:
            weight = self._counts[0] if by_tokens else self._counts[1]
            for name in losses:
                value = metrics.get(name)
                if isinstance(value, int | float):
                    value = torch.tensor(float(value), dtype=torch.float64).to(weight.device)
                    self.step.mean(name, value, weight=weight)
        sync = group is not None and torch.distributed.is_initialized()
        exact = self.mini_batch.compute(group=group, sync=sync)
        return {**metrics, **exact}

    def optimizer_step(self, lr_name: str, lr: float | None, grad_norm: float | None) -> None:
        """Log one optimizer step: its gradient norm and the learning rate it applied."""
        if grad_norm is not None:
            self.step.mean(GRAD_NORM, float(grad_norm))
        if lr is not None:
            self.step.last(lr_name, lr)


def _step_metrics(worker: Any) -> StepMetrics:
    metrics = worker.__dict__.get("_rlmetrics")
    if metrics is None:
        metrics = worker.__dict__["_rlmetrics"] = StepMetrics()
    return metrics


class _StepOwner:
    """What both exact workers add: the optimizer step's metrics, and the step's state
    for the trainer. ``LR_NAME`` is SkyRL's key for the role's learning rate."""

    LR_NAME = ""
    optimizer: Any

    def optim_step(self) -> Any:
        lr = optimizer_lr(self.optimizer)
        parent: Any = super()
        grad_norm = parent.optim_step()
        _step_metrics(self).optimizer_step(self.LR_NAME, lr, grad_norm)
        return grad_norm

    def take_step_metrics_state(self) -> TrackerState:
        """This rank's state of the step so far, and a new step begun (the trainer's
        call, once per training step)."""
        return _step_metrics(self).step.take_state()


class ExactFSDPPolicyWorkerBase(_StepOwner, FSDPPolicyWorkerBase):
    """SkyRL's ``FSDPPolicyWorkerBase`` whose update metrics are partition invariant.

    ``ExactPolicyWorker`` is this class as a Ray actor (what ``ExactRayPPOTrainer``
    hands SkyRL in place of its ``PolicyWorker``).
    """

    LR_NAME = "policy_lr"

    def forward_backward(
        self,
        data: Any,
        loss_fn: str | None = None,
        loss_fn_config: dict[str, Any] | None = None,
        return_per_token_outputs: bool = True,
    ) -> Any:
        metrics = _step_metrics(self)
        metrics.start()
        output = super().forward_backward(
            data,
            loss_fn=loss_fn,
            loss_fn_config=loss_fn_config,
            return_per_token_outputs=return_per_token_outputs,
        )
        by_tokens = self.cfg.algorithm.loss_reduction == "token_mean"
        exact = metrics.finish(
            output.metrics, self.device_mesh.get_group("dp"), POLICY_LOSSES, by_tokens
        )
        return dataclasses.replace(output, metrics=exact)

    def _forward_backward_micro(
        self,
        experience: Any,
        microbatch_weight: float,
        loss_fn: str | None = None,
        loss_fn_config: dict[str, Any] | None = None,
        return_per_token_outputs: bool = True,
    ) -> dict[str, Any]:
        status: dict[str, Any] = super()._forward_backward_micro(
            experience,
            microbatch_weight,
            loss_fn=loss_fn,
            loss_fn_config=loss_fn_config,
            return_per_token_outputs=return_per_token_outputs,
        )
        metrics = _step_metrics(self)
        metrics.log_micro_batch(status, experience, POLICY_TOKEN_MEANS, POLICY_SEQUENCE_MEANS)
        log_response_lengths(metrics.mini_batch, experience)
        return status


class ExactFSDPCriticWorkerBase(_StepOwner, FSDPCriticWorkerBase):
    """SkyRL's ``FSDPCriticWorkerBase`` whose update metrics are partition invariant.

    ``critic_loss`` is a mean over sequences here at every level: SkyRL's token-based
    batching logs each micro-batch's loss scaled by its share of the rank's sequences
    (the scale its gradient needs), which is undone before it is logged.
    """

    LR_NAME = "critic_lr"

    def forward_backward(self, data: Any) -> Any:
        metrics = _step_metrics(self)
        metrics.start()
        output = super().forward_backward(data)
        exact = metrics.finish(output.metrics, self.device_mesh.get_group("dp"), (), False)
        return dataclasses.replace(output, metrics=exact)

    def _forward_backward_micro(
        self, experience: Any, microbatch_weight: float | None = None
    ) -> dict[str, Any]:
        status: dict[str, Any] = super()._forward_backward_micro(
            experience, microbatch_weight=microbatch_weight
        )
        unscaled = dict(status)
        if microbatch_weight:  # token-based batching scaled the loss for its gradient
            unscaled["critic_loss"] = status["critic_loss"] / microbatch_weight
        metrics = _step_metrics(self)
        metrics.log_micro_batch(unscaled, experience, CRITIC_TOKEN_MEANS, CRITIC_SEQUENCE_MEANS)
        return status


# SkyRL's own Ray actor classes are made the same way (fsdp_worker.PolicyWorker, ...)
ExactPolicyWorker = ray.remote(num_gpus=1)(ExactFSDPPolicyWorkerBase)
ExactCriticWorker = ray.remote(num_gpus=1)(ExactFSDPCriticWorkerBase)
