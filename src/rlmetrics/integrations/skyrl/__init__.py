"""Exact policy and critic update metrics inside SkyRL (skyrl 0.4.0, FSDP workers).

SkyRL logs its update metrics as means of means: a mean per micro-batch, then plain
means over micro-batches, data-parallel ranks, and mini-batches and epochs, with the
zeros of token-based batching's padding micro-batches in each. ``ExactRayPPOTrainer``
(return it from ``BasePPOExp.get_trainer``) runs SkyRL's FSDP workers as subclasses
that log every micro-batch's metrics with the weight it stands for and merge them in one
packed collective per mini-batch, and replaces the trainer's average over mini-batches
with the exact merge of the whole step. Losses, gradients and optimizer steps are
SkyRL's. See docs/skyrl.md.

Importing this module refuses a SkyRL version it was not tested with.
"""

from __future__ import annotations

from rlmetrics.integrations.skyrl._version import SUPPORTED_SKYRL, check_version
from rlmetrics.integrations.skyrl.trainer import ExactRayPPOTrainer, exact_step_metrics
from rlmetrics.integrations.skyrl.worker import (
    ExactCriticWorker,
    ExactFSDPCriticWorkerBase,
    ExactFSDPPolicyWorkerBase,
    ExactPolicyWorker,
)

__all__ = [
    "SUPPORTED_SKYRL",
    "ExactCriticWorker",
    "ExactFSDPCriticWorkerBase",
    "ExactFSDPPolicyWorkerBase",
    "ExactPolicyWorker",
    "ExactRayPPOTrainer",
    "check_version",
    "exact_step_metrics",
]
