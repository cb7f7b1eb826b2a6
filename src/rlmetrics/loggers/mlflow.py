"""MlflowLogger: MLflow tracking (mlflow-skinny), by default a local file store.

The file store keeps one file per metric under the run's ``metrics/`` folder, so a
metric name is a path there. Names are sanitised the way MLflow requires (only
alphanumerics, ``_ - . /`` and spaces; no empty, ``.`` or ``..`` path segments; at most
250 characters), which also keeps every file inside the store. Each renaming is
reported once with a warning.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlmetrics.loggers.base import FailureReporter, LoggerWarning, as_float, missing_extra

MAX_NAME_LENGTH = 250
BATCH_SIZE = 1000  # MLflow's limit of metrics per log_batch call
INVALID_INPUT = "INVALID_PARAMETER_VALUE"  # MLflow's error code for a refused name or value
_BAD_CHARACTERS = re.compile(r"[^\w./\- ]", flags=re.ASCII)


def sanitize_name(name: str) -> str:
    """A name MLflow accepts on every platform, as close to ``name`` as possible.

    Characters outside ``[A-Za-z0-9_./ -]`` become "_" (colons too: Windows rejects
    them); empty and "." segments are dropped, and the leading dots of a segment that
    starts with ".." become "_" (``..`` -> ``__``, ``...x`` -> ``___x``), so the name is
    a normalised relative path that does not start with ".." (MLflow rejects those);
    names longer than 250 characters are cut and end in a short hash of the original.
    """
    clean = _BAD_CHARACTERS.sub("_", name)
    segments = [_no_leading_dots(s) for s in clean.split("/") if s not in ("", ".")]
    clean = "/".join(segments) or "_"
    if len(clean) > MAX_NAME_LENGTH:
        clean = clean[: MAX_NAME_LENGTH - 9].rstrip("/") + "-" + _digest(name)
    return clean


def _no_leading_dots(segment: str) -> str:
    if not segment.startswith(".."):
        return segment
    body = segment.lstrip(".")
    return "_" * (len(segment) - len(body)) + body


def _digest(name: str) -> str:
    return hashlib.sha1(name.encode("utf-8")).hexdigest()[:8]


class NameMap:
    """Remembers each metric's MLflow name; warns once per renamed metric.

    A renamed metric whose new name is already taken gets a short hash of its original
    name appended. Names MLflow accepts are mapped first in each step, so they keep
    their names unless an earlier step's renamed metric already took it.
    """

    def __init__(self) -> None:
        self._names: dict[str, str] = {}
        self._owners: dict[str, str] = {}

    def map_all(self, names: list[str]) -> dict[str, str]:
        """The MLflow name of each of ``names`` (valid names claimed first)."""
        ordered = sorted(names, key=lambda n: n not in self._names and sanitize_name(n) != n)
        mapped = {name: self(name) for name in ordered}
        return {name: mapped[name] for name in names}

    def __call__(self, name: str) -> str:
        mapped = self._names.get(name)
        if mapped is None:
            mapped = self._new(name)
        return mapped

    def _new(self, name: str) -> str:
        mapped = sanitize_name(name)
        if self._owners.get(mapped, name) != name:
            mapped = f"{mapped[: MAX_NAME_LENGTH - 9]}-{_digest(name)}"
        self._names[name] = mapped
        self._owners[mapped] = name
        if mapped != name:
            warnings.warn(
                f"rlmetrics: MLflow metric {name!r} is logged as {mapped!r} (MLflow names may "
                "only hold alphanumerics, '_', '-', '.', ' ' and '/' and form a clean "
                "relative path)",
                LoggerWarning,
                stacklevel=4,
            )
        return mapped


def file_uri(path: str | os.PathLike) -> str:
    """A ``file:`` tracking URI for a local folder."""
    return Path(path).resolve().as_uri()


class MlflowLogger:
    """Logs each step with one ``MlflowClient.log_batch`` call per 1000 metrics.

    The run is created at the first ``log`` (or ``state_dict``), so that resuming with
    ``load_state_dict`` continues the checkpointed run instead of leaving an empty one.
    For a ``file:`` URI the store's opt-in ``MLFLOW_ALLOW_FILE_STORE=true`` is set in
    ``os.environ`` unless already set (MLflow 3 refuses file stores otherwise).

    Args:
        tracking_uri: where runs go; None: ``file:<run_dir>/mlruns``.
        run_dir: the folder for the default file store.
        experiment: the experiment name (created when missing).
        run_name: the run's name.
        run_id: an existing run to continue.
    """

    name = "mlflow"

    def __init__(
        self,
        *,
        tracking_uri: str | None = None,
        run_dir: str | os.PathLike | None = None,
        experiment: str = "rlmetrics",
        run_name: str | None = None,
        run_id: str | None = None,
    ) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise missing_extra("MLflow", "mlflow", "mlflow", err) from err
        if tracking_uri is None:
            if run_dir is None:
                raise ValueError("MlflowLogger needs tracking_uri= or run_dir=")
            tracking_uri = file_uri(Path(run_dir) / "mlruns")
        if tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.experiment = experiment
        self.run_name = run_name
        self.run_id = run_id
        self.names = NameMap()
        self._rejected: set[str] = set()
        self._failures = FailureReporter(self.name)

    def _ensure_run(self) -> str:
        if self.run_id is None:
            found = self.client.get_experiment_by_name(self.experiment)
            experiment_id = (
                found.experiment_id if found else self.client.create_experiment(self.experiment)
            )
            run = self.client.create_run(experiment_id, run_name=self.run_name)
            self.run_id = run.info.run_id
        return self.run_id

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Log one step (renamed metrics are warned about once)."""
        from mlflow.entities import Metric

        with self._failures.guard("write"):
            run_id = self._ensure_run()
            stamp = int(time.time() * 1000)
            names = self.names.map_all(list(metrics))
            batch = [
                Metric(names[name], as_float(value), stamp, int(step))
                for name, value in metrics.items()
                if names[name] not in self._rejected
            ]
            for start in range(0, len(batch), BATCH_SIZE):
                self._log_batch(run_id, batch[start : start + BATCH_SIZE])

    def _log_batch(self, run_id: str, batch: list[Any]) -> None:
        """One ``log_batch``. When MLflow rejects its input, each metric goes alone, so a
        name MLflow refuses costs only itself (left out from then on, warned once)."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.log_batch(run_id, metrics=batch)
            return
        except MlflowException as err:
            if getattr(err, "error_code", None) != INVALID_INPUT:
                raise
        for metric in batch:  # MLflow validates a batch before writing any of it
            try:
                self.client.log_batch(run_id, metrics=[metric])
            except MlflowException as err:
                if getattr(err, "error_code", None) != INVALID_INPUT:
                    raise
                self._reject(metric.key, err)

    def _reject(self, key: str, err: Exception) -> None:
        self._rejected.add(key)
        warnings.warn(
            f"rlmetrics: MLflow rejected the metric {key!r} ({err}); it is left out from now "
            "on, the other metrics are logged",
            LoggerWarning,
            stacklevel=5,
        )

    def state_dict(self) -> dict[str, Any]:
        """The run id and tracking URI, to continue the same run."""
        return {"run_id": self._ensure_run(), "tracking_uri": self.tracking_uri}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the checkpointed run (call before the first ``log``)."""
        self.run_id = state["run_id"]

    def close(self) -> None:
        """Mark the run finished."""
        if self.run_id is None:
            return
        with self._failures.guard("finish"):
            self.client.set_terminated(self.run_id)
