"""Rank 0's output: the loggers (console table every k steps, JSONL, ...) and a progress
line per step."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlmetrics.loggers import build_loggers
from rlmetrics.trainer.config import TrainConfig

SCORE = "critic/score/mean"
PROGRESS = (  # (label, metric, format) of the progress line
    ("reward", SCORE, ".3f"),
    ("pg_clipfrac", "actor/pg_clipfrac", ".4f"),
    ("ppo_kl", "actor/ppo_kl", ".2e"),
    ("entropy", "actor/entropy", ".3f"),
)


class Reporter:
    """Fans each step's metrics out to the configured loggers and prints a progress line.

    A new run starts its JSONL file afresh (an existing file is truncated); a resumed
    one (``resume_step``, ``logger_state`` from a checkpoint) keeps the steps up to the
    checkpoint. The progress line (``progress_line``) is plain text, with or without
    rich, so a run shows what it does from its first step.
    """

    def __init__(
        self, cfg: TrainConfig, *, resume_step: int = 0, logger_state: Mapping | None = None
    ) -> None:
        run = cfg.run
        self.steps = run.steps
        self.progress = run.progress
        spec = [b for b in run.loggers.split(",") if b.strip() != "console" or run.log_every]
        options: dict[str, dict[str, Any]] = {}
        if run.metrics_jsonl is not None:
            options["jsonl"] = {"path": Path(run.metrics_jsonl)}
        self.loggers = build_loggers(
            spec,
            run_dir=run.run_dir,
            config=asdict(cfg),
            console_every=max(1, run.log_every),
            resume_step=resume_step,
            options=options,
        )
        if logger_state:
            self.loggers.load_state_dict(logger_state)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Write one step and print its progress line."""
        self.loggers.log(step, metrics)
        if self.progress:
            print(progress_line(step, self.steps, metrics), flush=True)

    def state_dict(self) -> dict[str, Any]:
        """The loggers' positions, for a checkpoint."""
        return self.loggers.state_dict()

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.loggers.close()
        sys.stdout.flush()


def progress_line(step: int, steps: int, metrics: Mapping[str, float]) -> str:
    """``step  12/150  reward 0.231  pg_clipfrac 0.0431  ...  3.8 s``: the step's key
    metrics (those it has) and its wall time."""
    width = len(str(steps))
    parts = [f"step {step:>{width}}/{steps}"]
    for label, name, spec in PROGRESS:
        value = metrics.get(name)
        if value is not None and not math.isnan(value):
            parts.append(f"{label} {value:{spec}}")
    seconds = metrics.get("timing_s/step")
    if seconds is not None:
        parts.append(f"{seconds:.1f} s")
    return "  ".join(parts)
