"""TensorBoardLogger: scalars through torch.utils.tensorboard's SummaryWriter."""

from __future__ import annotations

import os
from collections.abc import Mapping

from rlmetrics.loggers.base import FailureReporter, as_float, missing_extra


class TensorBoardLogger:
    """Writes each metric as a scalar (the metric name is the tag) at ``step``.

    Tags are not file names, so any metric name stays inside ``log_dir``.

    Args:
        log_dir: the event-file folder.
        resume_step: when resuming from a checkpoint taken at this step, events after
            it are purged (SummaryWriter's ``purge_step``).
        flush_each_step: flush the event file after every step (default True).
    """

    name = "tensorboard"

    def __init__(
        self,
        log_dir: str | os.PathLike,
        *,
        resume_step: int | None = None,
        flush_each_step: bool = True,
    ) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise missing_extra("TensorBoard", "tensorboard", "tensorboard", err) from err
        purge_step = None if resume_step is None else resume_step + 1
        self.log_dir = os.fspath(log_dir)
        self.writer = SummaryWriter(log_dir=self.log_dir, purge_step=purge_step)
        self.flush_each_step = flush_each_step
        self._failures = FailureReporter(self.name)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Add one scalar per metric."""
        for name, value in metrics.items():
            with self._failures.guard("write"):
                self.writer.add_scalar(name, as_float(value), global_step=step)
        if self.flush_each_step:
            with self._failures.guard("flush"):
                self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file; the failures not reported one by one are
        counted."""
        with self._failures.guard("close"):
            self.writer.close()
        self._failures.report_dropped()

    def __repr__(self) -> str:
        return f"TensorBoardLogger(log_dir={self.log_dir!r})"
