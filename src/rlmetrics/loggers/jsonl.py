"""JsonlLogger: one JSON object per step, flushed as it is written, safe to resume.

Format: ``{"step": 3, "actor/pg_loss": 0.25, ...}``, one line per step, metrics in the
order given. Non-finite values (NaN, +inf, -inf) are written as ``null``, so every line
is strict JSON that any reader parses; a reader sees a gap.

Resuming (the file already exists):

* The file is opened for appending and a resumed run never writes a step twice: a
  step at or below the last step found in the file is skipped (one warning). A torn
  last line, left by a crash in mid-write, is dropped. (Within one session, each
  ``log`` call writes a line: log a step once.)
* Resuming from a checkpoint (``resume_step=n`` or ``load_state_dict``) first truncates
  the file to the lines with ``step <= n``: the lines after the checkpoint belong to the
  run that was lost, and the resumed run writes those steps again.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlmetrics.loggers.base import FailureReporter, LoggerWarning, as_float

STEP_KEY = "step"


def encode_line(step: int, metrics: Mapping[str, Any]) -> str:
    """One step as a JSON line (non-finite values become null)."""
    row: dict[str, Any] = {STEP_KEY: int(step)}
    for name, value in metrics.items():
        number = as_float(value)
        row[name] = number if math.isfinite(number) else None
    return json.dumps(row, allow_nan=False) + "\n"


def step_of(row: Any) -> int:
    """The step of a parsed line: an integer (not a bool), or a float with an integral value.

    Raises:
        TypeError, ValueError: ``row`` is not an object with such a step.
    """
    step = row[STEP_KEY]
    if isinstance(step, bool) or not isinstance(step, int | float):
        raise TypeError(f"step must be an integer, got {step!r}")
    if isinstance(step, float) and not step.is_integer():
        raise ValueError(f"step must be an integer, got {step!r}")
    return int(step)


def parse_row(line: str) -> tuple[int, dict[str, float]] | None:
    """A line's step and numeric values (null as NaN), or None when the line is bad.

    Bad: not JSON (a torn line), nested too deeply to parse, not an object, no integer
    step, or a number beyond the float range. Non-numeric values are left out.
    """
    try:
        row = json.loads(line)
        step = step_of(row)
        values = {
            name: math.nan if value is None else float(value)
            for name, value in row.items()
            if name != STEP_KEY and (value is None or _is_number(value))
        }
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
        return None
    return step, values


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def read_steps(path: str | os.PathLike) -> list[tuple[int, str]]:
    """The (step, line) pairs of complete, parsable lines of a JSONL metrics file."""
    text = Path(path).read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines.pop()  # torn by a crash in mid-write
    out = []
    for line in lines:
        try:
            out.append((step_of(json.loads(line)), line))
        except (ValueError, KeyError, TypeError, RecursionError):
            continue
    return out


def rewrite(path: Path, lines: list[str]) -> None:
    """Replace ``path`` with ``lines`` atomically (a temp file in the same folder)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(lines)
    os.replace(tmp, path)


class JsonlLogger:
    """Appends one JSON object per step to ``path``, flushed every step.

    Args:
        path: the file (its folder is created).
        resume_step: when resuming from a checkpoint taken at this step, drop the
            file's lines after it first.
    """

    name = "jsonl"

    def __init__(self, path: str | os.PathLike, *, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._failures = FailureReporter(self.name)
        self._warned_skip = False
        self._warned_step_metric = False
        self.last_step: int | None = None
        self.resumed_step: int | None = None
        self._file: Any = None
        self._open(resume_step)

    def _open(self, resume_step: int | None) -> None:
        if self._file is not None:
            self._file.close()
        if self.path.exists():
            entries = read_steps(self.path)
            kept = [e for e in entries if resume_step is None or e[0] <= resume_step]
            if len(kept) != len(entries) or self._torn():
                rewrite(self.path, [line for _, line in kept])
            self.last_step = max((s for s, _ in kept), default=None)
        self.resumed_step = self.last_step
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open

    def _torn(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Write and flush one line (skipped when the file already has ``step``)."""
        if self.resumed_step is not None and step <= self.resumed_step:
            self._warn_skip(step)
            return
        if STEP_KEY in metrics:
            metrics = {k: v for k, v in metrics.items() if k != STEP_KEY}
            self._warn_step_metric()
        with self._failures.guard("write"):
            self._file.write(encode_line(step, metrics))
            self._file.flush()
            self.last_step = step if self.last_step is None else max(step, self.last_step)

    def _warn_step_metric(self) -> None:
        if self._warned_step_metric:
            return
        self._warned_step_metric = True
        warnings.warn(
            f"rlmetrics: the jsonl logger leaves out the metric named {STEP_KEY!r} (a metric "
            f"may not be named {STEP_KEY!r}: it would clash with the line's step key); the "
            "other metrics are written. Further steps drop it without a warning.",
            LoggerWarning,
            stacklevel=3,
        )

    def _warn_skip(self, step: int) -> None:
        if self._warned_skip:
            return
        self._warned_skip = True
        warnings.warn(
            f"rlmetrics: {self.path} already holds steps up to {self.resumed_step}; step {step} "
            "and any later step not above it are skipped (pass resume_step= to rewrite them)",
            LoggerWarning,
            stacklevel=3,
        )

    def state_dict(self) -> dict[str, Any]:
        """The last step written (checkpoint it with the model)."""
        return {"path": str(self.path), "last_step": self.last_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a checkpoint: drop the lines written after its ``last_step``."""
        last = state.get("last_step")
        self._open(-1 if last is None else int(last))

    def close(self) -> None:
        """Close the file; the failures not reported one by one are counted."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._failures.report_dropped()
