"""MultiLogger and build_loggers: one call fans a step out to every backend."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlmetrics.loggers.base import FailureReporter, Logger, has_state

BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


class MultiLogger:
    """Sends each step to several loggers; one failing never affects the others.

    Args:
        loggers: the backends, as a sequence or a mapping name -> logger (a sequence
            is named by each logger's ``name`` attribute or class name).
    """

    def __init__(self, loggers: Sequence[Logger] | Mapping[str, Logger] = ()) -> None:
        if isinstance(loggers, Mapping):
            self.loggers = dict(loggers)
        else:
            self.loggers = {}
            for logger in loggers:
                base = getattr(logger, "name", None) or type(logger).__name__
                name, n = base, 1
                while name in self.loggers:
                    n += 1
                    name = f"{base}{n}"
                self.loggers[name] = logger
        self._failures = {name: FailureReporter(name) for name in self.loggers}

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Send one step to every logger."""
        self._each("log", lambda logger: logger.log(step, metrics))

    def close(self) -> None:
        """Close every logger; the failures not reported one by one are counted."""
        self._each("close", lambda logger: logger.close())
        for failures in self._failures.values():
            failures.report_dropped()

    def state_dict(self) -> dict[str, Any]:
        """The states of the loggers that have one, by name."""
        out: dict[str, Any] = {}
        for name, logger in self.loggers.items():
            if has_state(logger):
                with self._failures[name].guard("save its state"):
                    out[name] = logger.state_dict()
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Give each logger its part of ``state`` (loggers missing from it are left)."""
        for name, logger in self.loggers.items():
            if name in state and has_state(logger):
                logger.load_state_dict(state[name])

    def _each(self, operation: str, call: Callable[[Any], None]) -> None:
        for name, logger in self.loggers.items():
            with self._failures[name].guard(operation):
                call(logger)

    def __len__(self) -> int:
        return len(self.loggers)

    def __getitem__(self, name: str) -> Logger:
        return self.loggers[name]

    def __enter__(self) -> MultiLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_backends(spec: str | Iterable[str]) -> list[str]:
    """``"console,jsonl"`` (or a list) as validated, de-duplicated backend names."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for raw in names:
        name = raw.strip().lower()
        if not name or name == "none" or name in out:
            continue
        if name not in BACKENDS:
            raise ValueError(
                f"unknown logger {raw!r} in {spec!r}; choose from {', '.join(BACKENDS)}"
            )
        out.append(name)
    return out


def build_loggers(
    spec: str | Iterable[str],
    *,
    run_dir: str | os.PathLike,
    run_name: str | None = None,
    project: str = "rlmetrics",
    config: Mapping[str, Any] | None = None,
    console_every: int = 1,
    resume_step: int | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> MultiLogger:
    """Build the loggers named in ``spec`` ("console,jsonl,tensorboard,wandb,mlflow").

    Files go under ``run_dir``: ``metrics.jsonl``, ``tensorboard/``, ``wandb/`` and
    ``mlruns/`` (a local MLflow file store).

    Args:
        spec: backend names, comma-separated or a list; "" or "none" for no logger.
        run_dir: the run's folder (created).
        run_name: the run's name in W&B and MLflow.
        project: the W&B project and MLflow experiment.
        config: hyperparameters recorded by W&B.
        console_every: print every this many steps.
        resume_step: resuming from a checkpoint at this step (JSONL and TensorBoard
            drop what was written after it).
        options: extra constructor arguments per backend name.

    Raises:
        ValueError: an unknown backend name.
        ImportError: a backend's library is missing (the message names the extra).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    options = options or {}
    loggers: dict[str, Logger] = {}
    for name in parse_backends(spec):
        kwargs = dict(options.get(name, {}))
        loggers[name] = _build(
            name, run_dir, run_name, project, config, console_every, resume_step, kwargs
        )
    return MultiLogger(loggers)


def _build(
    name: str,
    run_dir: Path,
    run_name: str | None,
    project: str,
    config: Mapping[str, Any] | None,
    console_every: int,
    resume_step: int | None,
    kwargs: dict[str, Any],
) -> Logger:
    if name == "console":
        from rlmetrics.loggers.console import ConsoleLogger

        return ConsoleLogger(**{"every": console_every, **kwargs})
    if name == "jsonl":
        from rlmetrics.loggers.jsonl import JsonlLogger

        return JsonlLogger(
            kwargs.pop("path", run_dir / "metrics.jsonl"), **{"resume_step": resume_step, **kwargs}
        )
    if name == "tensorboard":
        from rlmetrics.loggers.tensorboard import TensorBoardLogger

        return TensorBoardLogger(
            kwargs.pop("log_dir", run_dir / "tensorboard"), **{"resume_step": resume_step, **kwargs}
        )
    if name == "wandb":
        from rlmetrics.loggers.wandb import WandbLogger

        defaults = {"project": project, "dir": run_dir, "name": run_name, "config": config}
        return WandbLogger(**{**defaults, **kwargs})
    from rlmetrics.loggers.mlflow import MlflowLogger

    defaults = {"run_dir": run_dir, "experiment": project, "run_name": run_name}
    return MlflowLogger(**{**defaults, **kwargs})
