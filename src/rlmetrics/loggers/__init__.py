"""Metric loggers: console, JSONL, TensorBoard, W&B, MLflow, and a fan-out.

Every backend takes ``log(step, metrics)`` and ``close()``; each imports its library
in its constructor, so importing this package needs none of them. A failed write
warns (``LoggerWarning``) and training continues.

Examples:
    >>> loggers = build_loggers("jsonl", run_dir=tmp_dir)  # doctest: +SKIP
    >>> loggers.log(1, {"actor/pg_loss": 0.5})  # doctest: +SKIP
"""

from rlmetrics.loggers.base import Logger, LoggerWarning, has_state
from rlmetrics.loggers.console import ConsoleLogger
from rlmetrics.loggers.jsonl import JsonlLogger
from rlmetrics.loggers.mlflow import MlflowLogger, sanitize_name
from rlmetrics.loggers.multi import BACKENDS, MultiLogger, build_loggers, parse_backends
from rlmetrics.loggers.tensorboard import TensorBoardLogger
from rlmetrics.loggers.wandb import WandbLogger

__all__ = [
    "BACKENDS",
    "ConsoleLogger",
    "JsonlLogger",
    "Logger",
    "LoggerWarning",
    "MlflowLogger",
    "MultiLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "build_loggers",
    "has_state",
    "parse_backends",
    "sanitize_name",
]
