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
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rlmetrics.loggers.base import FailureReporter, LoggerWarning, as_float, missing_extra

MAX_NAME_LENGTH = 250
BATCH_SIZE = 1000  # MLflow's limit of metrics per log_batch call
VALUE_LEAF = "value"  # a file-store metric whose name is also a folder: <name>/value
FAILED_ALONE_LIMIT = 2  # failures in a row, with none logged, that end a one-by-one resend
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

    With ``paths=True`` (a file store: one file per metric, the name its path) no
    metric's file is also a folder of another's. A new name that is a path prefix of
    another (one of the same step, or one mapped before) gets ``/value`` appended:
    ``timing_s/gen`` beside ``timing_s/gen/mean`` is ``timing_s/gen/value``. A new name
    under an existing metric file (``a/b/c`` after ``a/b`` was logged alone) has the
    ``/`` after that file's name replaced by ``.``: ``a/b.c``. ``claim`` enters the
    names a continued run already holds, so a resumed run maps its names as before.
    """

    def __init__(self, *, paths: bool = False) -> None:
        self.paths = paths
        self._names: dict[str, str] = {}
        self._owners: dict[str, str] = {}
        self._files: set[str] = set()  # MLflow names in use
        self._folders: set[str] = set()  # their proper path prefixes

    def original(self, mapped: str) -> str:
        """The metric logged as ``mapped`` (``mapped`` itself if none is known)."""
        return self._owners.get(mapped, mapped)

    def claim(self, keys: Iterable[str]) -> None:
        """Mark MLflow names already in the run (a continued run) as taken paths; the
        first metric that maps to one of them keeps logging there."""
        for key in keys:
            self._take(key)

    def map_all(self, names: list[str]) -> dict[str, str]:
        """The MLflow name of each of ``names`` (valid names claimed first)."""
        ordered = sorted(names, key=lambda n: n not in self._names and sanitize_name(n) != n)
        pending: set[str] = set()
        if self.paths:
            for name in names:
                if name not in self._names:
                    pending.update(_folders(sanitize_name(name)))
        mapped = {name: self._map(name, pending) for name in ordered}
        return {name: mapped[name] for name in names}

    def __call__(self, name: str) -> str:
        return self._map(name, set())

    def _map(self, name: str, pending: set[str]) -> str:
        mapped = self._names.get(name)
        if mapped is None:
            mapped = self._new(name, pending)
        return mapped

    def _new(self, name: str, pending: set[str]) -> str:
        clean = sanitize_name(name)
        mapped = self._free_path(clean, pending) if self.paths else clean
        reasons = []
        if clean != name:
            reasons.append(
                "MLflow names may only hold alphanumerics, '_', '-', '.', ' ' and '/' and "
                "form a clean relative path"
            )
        if mapped != clean:
            reasons.append(
                "in MLflow's file store a name is a file path, and a metric's file cannot "
                "also be the folder of another metric"
            )
        if self._owners.get(mapped, name) != name:
            mapped = f"{mapped[: MAX_NAME_LENGTH - 9]}-{_digest(name)}"
            reasons.append("its name was taken by another metric")
        self._names[name] = mapped
        self._owners[mapped] = name
        self._take(mapped)
        if mapped != name:
            why = "; ".join(reasons)
            warnings.warn(
                f"rlmetrics: MLflow metric {name!r} is logged as {mapped!r} ({why})",
                LoggerWarning,
                stacklevel=4,
            )
        return mapped

    def _free_path(self, name: str, pending: set[str]) -> str:
        """``name`` changed until it is neither under a metric file nor a folder (a name
        that is already a metric's file stays: a continued run's names keep theirs)."""
        while name not in self._files:
            parts = name.split("/")
            under = next(
                (i for i in range(1, len(parts)) if "/".join(parts[:i]) in self._files), None
            )
            if under is not None:  # the "/" after that file's name becomes "."
                parts[under - 1 : under + 1] = [f"{parts[under - 1]}.{parts[under]}"]
                name = "/".join(parts)
            elif name in self._folders or name in pending:
                name = f"{name}/{VALUE_LEAF}"
            else:
                break
        if len(name) > MAX_NAME_LENGTH:
            name = name[: MAX_NAME_LENGTH - 9].rstrip("/") + "-" + _digest(name)
        return name

    def _take(self, mapped: str) -> None:
        self._files.add(mapped)
        self._folders.update(_folders(mapped))


def _folders(name: str) -> list[str]:
    """The proper path prefixes of ``name``: ``a/b/c`` -> ``a``, ``a/b``."""
    parts = name.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def is_file_store(tracking_uri: str) -> bool:
    """Whether MLflow keeps this URI's runs as files (``file:`` or a plain path)."""
    from urllib.parse import urlparse

    scheme = urlparse(tracking_uri).scheme
    return scheme in ("", "file") or len(scheme) == 1  # one letter: a Windows drive


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
        self.names = NameMap(paths=is_file_store(tracking_uri))
        self._rejected: set[str] = set()
        self._claimed = False
        self._failures = FailureReporter(self.name)

    def _ensure_run(self) -> str:
        if self.run_id is None:
            found = self.client.get_experiment_by_name(self.experiment)
            experiment_id = (
                found.experiment_id if found else self.client.create_experiment(self.experiment)
            )
            run = self.client.create_run(experiment_id, run_name=self.run_name)
            self.run_id = run.info.run_id
            self._claimed = True
        elif not self._claimed:  # a continued run: its metric names are taken paths
            if self.names.paths:
                self.names.claim(self.client.get_run(self.run_id).data.metrics)
            self._claimed = True
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
        """One ``log_batch``. When it fails, for whatever reason, each metric goes alone,
        so a metric MLflow refuses costs only itself: it is left out from then on, with a
        warning naming it and the error.

        A metric is refused only when it fails alone while another one of the batch is
        logged; when the first ``FAILED_ALONE_LIMIT`` fail with none logged, the store
        itself is failing: the batch's error is raised (the logger's failure policy
        reports it) and no metric is refused. A batch that failed part way (a file store
        writes metric by metric) may have written some metrics already: the resend
        writes those again, the same value twice at that step.
        """
        try:
            self.client.log_batch(run_id, metrics=batch)
            return
        except Exception as err:  # any refusal: the metrics go one by one
            batch_error = err
        refused: list[tuple[Any, Exception]] = []
        logged = 0
        for metric in batch:
            try:
                self.client.log_batch(run_id, metrics=[metric])
                logged += 1
            except Exception as err:
                refused.append((metric, err))
                if not logged and len(refused) >= min(FAILED_ALONE_LIMIT, len(batch)):
                    raise batch_error from err
        for metric, error in refused:
            self._reject(metric.key, error)

    def _reject(self, key: str, err: Exception) -> None:
        self._rejected.add(key)
        original = self.names.original(key)
        alias = f" (logged as {key!r})" if original != key else ""
        warnings.warn(
            f"rlmetrics: MLflow rejected the metric {original!r}{alias} "
            f"({type(err).__name__}: {err}); it is left out from now on, the other metrics "
            "are logged",
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
        """Mark the run finished; the failures not reported one by one are counted."""
        if self.run_id is not None:
            with self._failures.guard("finish"):
                self.client.set_terminated(self.run_id)
        self._failures.report_dropped()
