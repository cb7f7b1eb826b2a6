"""Rank 0's output: the loggers (console table every k steps, JSONL, ...) and a progress bar."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlmetrics.loggers import build_loggers
from rlmetrics.trainer.config import TrainConfig

SCORE = "critic/score/mean"


class Reporter:
    """Fans each step's metrics out to the configured loggers and advances a progress bar.

    A new run starts its JSONL file afresh (an existing file is truncated); a resumed
    one (``resume_step``, ``logger_state`` from a checkpoint) keeps the steps up to the
    checkpoint. The bar (rich) shares its console with the console logger, so tables
    print above it.
    """

    def __init__(
        self, cfg: TrainConfig, *, resume_step: int = 0, logger_state: Mapping | None = None
    ) -> None:
        run = cfg.run
        self.progress = _progress(run.progress)
        spec = [b for b in run.loggers.split(",") if b.strip() != "console" or run.log_every]
        options: dict[str, dict[str, Any]] = {}
        if run.metrics_jsonl is not None:
            options["jsonl"] = {"path": Path(run.metrics_jsonl)}
        if self.progress is not None:
            options["console"] = {"console": self.progress.console}
        self.loggers = build_loggers(
            spec, run_dir=run.run_dir, config=asdict(cfg), console_every=max(1, run.log_every),
            resume_step=resume_step, options=options,
        )  # fmt: skip
        if logger_state:
            self.loggers.load_state_dict(logger_state)
        self.task = None
        if self.progress is not None:
            self.progress.start()
            self.task = self.progress.add_task(
                "training", total=run.steps, completed=resume_step, score=float("nan")
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Write one step and advance the bar."""
        self.loggers.log(step, metrics)
        if self.progress is not None:
            self.progress.update(self.task, completed=step, score=metrics.get(SCORE, float("nan")))

    def state_dict(self) -> dict[str, Any]:
        """The loggers' positions, for a checkpoint."""
        return self.loggers.state_dict()

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.loggers.close()


def _progress(enabled: bool) -> Any:
    """A rich progress bar with the mean reward, or None (disabled or rich missing)."""
    if not enabled:
        return None
    try:
        from rich import progress as rp
    except ImportError:
        return None
    return rp.Progress(
        rp.TextColumn("[bold]{task.description}"), rp.BarColumn(), rp.MofNCompleteColumn(),
        rp.TextColumn("reward {task.fields[score]:.3f}"), rp.TimeElapsedColumn(),
        rp.TimeRemainingColumn(),
    )  # fmt: skip
