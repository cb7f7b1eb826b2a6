"""The reference distributed GRPO/PPO trainer: the library end to end, on a toy task.

Read it top to bottom: ``config`` (dataclasses), ``task`` (the verifiable task),
``model`` (a tiny causal transformer), ``rollout`` (sampling and sharding), ``update``
(losses and the mini-/micro-batch loop), ``extras`` (the opt-in metrics), ``train``
(the per-rank loop), ``report`` (rank 0's loggers) and ``launch`` (spawn, torchrun).
``python -m rlmetrics.trainer`` is the torchrun entry point; ``rlmetrics demo`` spawns
local ranks.
"""

from rlmetrics.trainer.config import (
    AlgoConfig,
    MetricsConfig,
    ModelConfig,
    RunConfig,
    TaskConfig,
    TrainConfig,
)
from rlmetrics.trainer.launch import from_env, spawn
from rlmetrics.trainer.train import train

__all__ = [
    "AlgoConfig",
    "MetricsConfig",
    "ModelConfig",
    "RunConfig",
    "TaskConfig",
    "TrainConfig",
    "from_env",
    "spawn",
    "train",
]
