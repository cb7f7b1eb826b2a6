"""verl's driver data metrics per data source (``RLMETRICS_VERL_DETAIL=1``).

Each training step verl's driver reports ``compute_data_metrics(batch, use_critic)``
(``verl.trainer.ppo.metric_utils``): ``critic/score/*``, ``critic/rewards/*``,
``critic/advantages/*``, ``critic/returns/*``, ``critic/values/*``,
``response_length/*``, ``prompt_length/*`` and the rest, over the whole batch, which
the driver holds. ``data_metrics_by_source`` reports every one of those keys again for
each data source's rows alone, as ``<key>/<source>``: verl's own function on the rows
whose ``data_source`` is that source, so each value is exact over the whole batch's
rows of that source and means what verl's key means. Nothing here is synced: the
driver already has every row.

With the switch on, ``enable()`` has verl's trainers call ``with_sources``'s wrapper
in place of ``compute_data_metrics`` (``install``): it returns verl's dict, plus the
per-source keys when the switch is on at the call. With the switch off the dict is
verl's, unchanged.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from rlmetrics.integrations.verl import detail

METRICS_MODULE = "verl.trainer.ppo.metric_utils"
"""The module that defines ``compute_data_metrics``."""
TRAINER_MODULES = (
    "verl.trainer.ppo.ray_trainer",
    "verl.trainer.ppo.v1.trainer_base",
    "verl.experimental.separation.ray_trainer",
)
"""verl 0.9.1's trainers that import ``compute_data_metrics`` by name and call it."""
FUNCTION = "compute_data_metrics"
WRAPPED = "__rlmetrics_wrapped__"
"""The attribute of the wrapper that holds verl's function."""


def _verl_function() -> Callable[..., dict[str, Any]]:
    """verl's own ``compute_data_metrics`` (unwrapped)."""
    from verl.trainer.ppo import metric_utils

    function = getattr(metric_utils, FUNCTION)
    return getattr(function, WRAPPED, function)


def data_metrics_by_source(batch: Any, use_critic: bool = True) -> dict[str, float]:
    """verl's ``compute_data_metrics`` for each data source's rows of ``batch`` (a
    ``DataProto`` as the driver holds it after the update), as ``<key>/<source>``.

    Returns an empty dict when the batch has no ``data_source``. A source's keys are
    those verl reports for its rows (verl's NaN, with its warning, where the source's
    rows leave nothing to average, as for a whole batch).
    """
    sources = batch.non_tensor_batch.get(detail.SOURCE_KEY)
    if sources is None or len(sources) == 0:
        return {}
    compute = _verl_function()
    labels = np.asarray([str(source) for source in sources], dtype=object)
    out: dict[str, float] = {}
    for source in sorted(set(labels.tolist())):
        rows = np.flatnonzero(labels == source)
        metrics = compute(batch=batch.select_idxs(rows), use_critic=use_critic)
        out.update({f"{key}/{source}": value for key, value in metrics.items()})
    return out


def with_sources(function: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """``function`` (verl's ``compute_data_metrics``) that also returns
    ``data_metrics_by_source`` when ``RLMETRICS_VERL_DETAIL`` is on at the call."""

    @functools.wraps(function)
    def compute_data_metrics(batch: Any, use_critic: bool = True) -> dict[str, Any]:
        metrics = function(batch=batch, use_critic=use_critic)
        if detail.enabled():
            metrics.update(data_metrics_by_source(batch, use_critic))
        return metrics

    setattr(compute_data_metrics, WRAPPED, function)
    return compute_data_metrics


def install() -> None:
    """Point ``metric_utils.compute_data_metrics`` and the loaded trainers' copies of it
    at the wrapper (idempotent). Called right after ``metric_utils`` is imported, so
    trainers imported later take the wrapper with their own import."""
    metric_utils = sys.modules[METRICS_MODULE]
    original = _verl_function()
    wrapper = getattr(metric_utils, FUNCTION)
    if getattr(wrapper, WRAPPED, None) is not original:
        wrapper = with_sources(original)
        setattr(metric_utils, FUNCTION, wrapper)
    for name in TRAINER_MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, FUNCTION, None) is original:
            setattr(module, FUNCTION, wrapper)


def uninstall() -> None:
    """verl's own ``compute_data_metrics`` again, wherever ``install`` put the wrapper."""
    metric_utils = sys.modules.get(METRICS_MODULE)
    if metric_utils is None:
        return
    wrapper = getattr(metric_utils, FUNCTION)
    original = getattr(wrapper, WRAPPED, None)
    if original is None:
        return
    for module in [metric_utils, *(sys.modules.get(name) for name in TRAINER_MODULES)]:
        if module is not None and getattr(module, FUNCTION, None) is wrapper:
            setattr(module, FUNCTION, original)
