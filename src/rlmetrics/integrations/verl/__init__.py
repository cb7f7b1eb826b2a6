"""Exact actor and critic update metrics inside real verl runs (verl 0.9.1).

Importing this module turns it on in the importing process (``enable()``); installing
rlmetrics next to verl turns it on in every process that imports verl (driver and Ray
workers alike), through verl's own plugin hook: the ``verl.plugins`` entry point
``rlmetrics`` (see docs/verl.md). ``VERL_USE_EXTERNAL_PLUGINS=none`` (verl's switch)
leaves it off.

What ``enable()`` changes, and nothing else: verl builds its actor's inner worker from
``ActorRolloutRefWorker.actor_worker_cls`` (a class attribute meant for this) and its
critic from ``verl.workers.engine_workers.TrainingWorker``; both are pointed at
``ExactTrainingWorker``, a subclass whose update metrics are partition invariant.
On the driver, the name verl's V1 trainers build the aggregator of a step's iterations
from (``MetricsAggregator`` in ``verl.trainer.ppo.v1.trainer_base``) is pointed at one
that merges the workers' states exactly (``rlmetrics.integrations.verl.async_steps``).
No verl function is replaced but two: one for DataProto metrics (``DataProtoFuture.get``:
see ``rlmetrics.integrations.verl.dataproto``), and the driver's ``compute_data_metrics``,
by a wrapper that returns verl's dict unchanged unless ``RLMETRICS_VERL_DETAIL`` is on
(then it adds the per-source keys: ``rlmetrics.integrations.verl.data_metrics``). Other
verl versions are refused with an error, since the subclass relies on how 0.9.1 produces
its metrics.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

from rlmetrics.integrations.verl import async_steps, data_metrics
from rlmetrics.integrations.verl._version import SUPPORTED_VERL, check_version
from rlmetrics.integrations.verl.data_metrics import data_metrics_by_source

WORKERS_MODULE = "verl.workers.engine_workers"
WORKER_MODULE = "rlmetrics.integrations.verl.worker"
"""The module that defines ``ExactTrainingWorker`` (it imports ``WORKERS_MODULE``)."""

_ORIGINAL: dict[str, type] = {}
_switch_pending = False
"""True while a switch waits for ``WORKER_MODULE`` to define its class."""


def enable() -> None:
    """Make this process's verl actor and critic updates report exact metrics.

    Idempotent, and cheap: when verl's workers module is not imported yet (the plugin
    runs inside ``import verl``), the switch happens right after it is, so importing
    verl stays as light as before. Modules that copied ``TrainingWorker`` into their
    own namespace before the switch (``verl.trainer.ppo.v1.trainer_base``) are pointed
    at the subclass too.

    Raises:
        RuntimeError: the installed verl is not a tested version.
    """
    check_version()
    from rlmetrics.integrations.verl.dataproto import merge_futures

    merge_futures(True)
    _after_import(WORKERS_MODULE, _switch)
    _after_import(data_metrics.METRICS_MODULE, data_metrics.install)
    _after_import(async_steps.TRAINER_MODULE, async_steps.install)


def _after_import(name: str, callback: Callable[[], None]) -> None:
    """Run ``callback`` now if module ``name`` is loaded, else right after its import
    (once: one waiting finder per module)."""
    if name in sys.modules:
        callback()
    elif not any(
        isinstance(finder, _AfterImport) and finder.name == name for finder in sys.meta_path
    ):
        sys.meta_path.insert(0, _AfterImport(name, callback))


def _switch() -> None:
    """Point verl's worker classes at ``ExactTrainingWorker`` (verl's workers module is
    loaded). When the worker module is itself importing verl's workers module (it was
    imported first: directly, or by unpickling a class that names it, as Ray does), it
    has no ``ExactTrainingWorker`` yet: the switch is left to its last line
    (``_switch_when_defined``), right after the class is defined."""
    global _switch_pending
    worker = sys.modules.get(WORKER_MODULE)
    _switch_pending = worker is not None and not hasattr(worker, "ExactTrainingWorker")
    if _switch_pending:
        return
    engine_workers = sys.modules[WORKERS_MODULE]

    from rlmetrics.integrations.verl.worker import ExactTrainingWorker

    if not _ORIGINAL:
        _ORIGINAL["TrainingWorker"] = engine_workers.TrainingWorker
        _ORIGINAL["actor_worker_cls"] = engine_workers.ActorRolloutRefWorker.actor_worker_cls
    original = _ORIGINAL["TrainingWorker"]
    engine_workers.ActorRolloutRefWorker.actor_worker_cls = ExactTrainingWorker
    for module in _importers():
        if getattr(module, "TrainingWorker", None) is original:
            module.TrainingWorker = ExactTrainingWorker


def _switch_when_defined() -> None:
    """Finish a switch that verl's workers module asked for while the worker module was
    being imported (see ``_switch``); nothing to do otherwise. The worker module's last
    line."""
    if _switch_pending:
        _switch()


def disable() -> None:
    """Undo ``enable()`` (verl's own classes again, in every module ``enable`` changed)."""
    global _switch_pending
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterImport)]
    _switch_pending = False
    from rlmetrics.integrations.verl.dataproto import merge_futures

    merge_futures(False)
    data_metrics.uninstall()  # nothing to undo before verl's metric_utils is imported
    async_steps.uninstall()
    if not _ORIGINAL:
        return
    engine_workers = sys.modules[WORKERS_MODULE]

    from rlmetrics.integrations.verl.worker import ExactTrainingWorker

    engine_workers.ActorRolloutRefWorker.actor_worker_cls = _ORIGINAL["actor_worker_cls"]
    for module in _importers():
        if getattr(module, "TrainingWorker", None) is ExactTrainingWorker:
            module.TrainingWorker = _ORIGINAL["TrainingWorker"]


def is_enabled() -> bool:
    """Whether this process's verl actor uses ``ExactTrainingWorker`` (or will, once
    verl's workers module is imported)."""
    if WORKERS_MODULE not in sys.modules:
        return any(
            isinstance(finder, _AfterImport) and finder.name == WORKERS_MODULE
            for finder in sys.meta_path
        )
    from verl.workers import engine_workers

    from rlmetrics.integrations.verl.worker import ExactTrainingWorker

    return engine_workers.ActorRolloutRefWorker.actor_worker_cls is ExactTrainingWorker


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback`` once, right after the module ``name`` is first executed."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; the other finders locate the module
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ThenCall(spec.loader, self.callback)
        return spec


class _ThenCall(importlib.abc.Loader):
    """A loader that executes the module with ``loader``, then calls ``callback``."""

    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[], None]) -> None:
        self.loader = loader
        self.callback = callback

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        self.callback()


def _importers() -> list:
    """verl's loaded modules (engine_workers first): those that may hold TrainingWorker."""
    trainers = sorted(name for name in list(sys.modules) if name.startswith("verl.trainer"))
    names = [WORKERS_MODULE, *trainers]
    return [sys.modules[name] for name in names if sys.modules.get(name) is not None]


enable()

__all__ = [
    "SUPPORTED_VERL",
    "check_version",
    "data_metrics_by_source",
    "disable",
    "enable",
    "is_enabled",
]
