"""WandbLogger: Weights & Biases, online or offline (``WANDB_MODE=offline``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from rlmetrics.loggers.base import FailureReporter, as_float, missing_extra


class WandbLogger:
    """Logs each step with ``run.log(metrics, step=step)``.

    The run is created in the constructor with ``wandb.init``; ``mode`` None follows
    ``WANDB_MODE`` (set it to "offline" to write only the local run folder, to be
    synced later with ``wandb sync``). To resume a run, pass ``id=`` and
    ``resume="allow"`` (forwarded to ``wandb.init``); ``state_dict()`` holds the id.

    Args:
        project: the W&B project.
        dir: where wandb puts its ``wandb/`` run folders (default: wandb's choice).
        name: the run's display name.
        config: the run config (hyperparameters).
        mode: "online", "offline" or "disabled"; None follows the environment.
        **init_kwargs: more ``wandb.init`` arguments.
    """

    name = "wandb"

    def __init__(
        self,
        *,
        project: str | None = None,
        dir: str | os.PathLike | None = None,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        mode: Literal["online", "offline", "disabled"] | None = None,
        **init_kwargs: Any,
    ) -> None:
        try:
            import wandb
        except ImportError as err:
            raise missing_extra("W&B", "wandb", "wandb", err) from err
        if dir is not None:
            os.makedirs(dir, exist_ok=True)
            init_kwargs["dir"] = os.fspath(dir)
        if _version(wandb.__version__) >= (0, 19):
            init_kwargs.setdefault("reinit", "create_new")  # independent runs per logger
        self.run = wandb.init(
            project=project, name=name, config=dict(config or {}), mode=mode, **init_kwargs
        )
        self._failures = FailureReporter(self.name)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Log one step (W&B steps must increase)."""
        with self._failures.guard("write"):
            self.run.log({k: as_float(v) for k, v in metrics.items()}, step=step)

    def state_dict(self) -> dict[str, Any]:
        """The run id, to pass as ``id=`` when resuming."""
        return {"run_id": self.run.id}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Check that the checkpoint belongs to this run (resume with ``id=``)."""
        run_id = state.get("run_id")
        if run_id is not None and run_id != self.run.id:
            self._failures.report(
                "resume",
                ValueError(
                    f"checkpoint is from W&B run {run_id!r} but this is run {self.run.id!r}; "
                    "pass id=<run id> and resume='allow' to continue the same run"
                ),
            )

    def close(self) -> None:
        """Finish the run (writes the offline run's last records); the failures not
        reported one by one are counted."""
        with self._failures.guard("finish"):
            self.run.finish()
        self._failures.report_dropped()


def _version(text: str) -> tuple[int, ...]:
    """(major, minor) of a version string ("0.19.1" -> (0, 19))."""
    parts = []
    for part in text.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)
