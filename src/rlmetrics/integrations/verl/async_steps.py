"""A V1 trainer step of several iterations, reported as one batch (verl 0.9.1).

verl's V1 trainers (``verl.trainer.ppo.v1``) run ``parameter_sync_step`` iterations
per logged step (sample, update the critic, update the actor; ``separate_async`` 4 by
default, ``colocate_async`` and ``sync`` 1) and merge the iterations' metric dicts
with ``MetricsAggregator``: each key by a rule read from its spelling, a mean weighted
by the iteration's sample count. The actor's and critic's metrics of each iteration
are exact (``ExactTrainingWorker``), but a sample-weighted mean of exact token means
is not the step's token mean, and verl's time keys are averaged.

Two parts, both installed by ``enable()``:

* the worker: when it serves a V1 trainer (its batches come through TransferQueue),
  ``ExactTrainingWorker`` returns, next to its values, the merged state they were
  computed from, under ``STATE_KEY``: a verl ``Metric`` whose ``aggregate()`` is the
  state (``rlmetrics.integrations.verl.worker.StepState``), so verl's
  ``reduce_metrics`` on the driver hands it on as ``<role>/rlmetrics_state``. Called
  by the V0 trainer or by hand, it returns its values only, since nothing there would
  merge the state.
* the driver: the name ``MetricsAggregator`` in ``verl.trainer.ppo.v1.trainer_base``
  (imported from ``verl.trainer.ppo.v1.utils``; ``PPOTrainer.step`` builds one a step
  from it) points at ``StepMetricsAggregator``: the exact
  aggregator of ``rlmetrics.compat.verl`` (verl's rules for plain numbers, keys ending
  in ``count`` summed), which merges each iteration's states by their kinds in place
  of the values they replace: token means weighted by tokens, sums summed, max and
  min as such, ``lr`` the last iteration's, ``grad_norm`` the mean over every
  optimizer step, and the rank times (``<role>/update_time_s``) summed per rank over
  the iterations before the slowest rank is taken.

No verl function is replaced: the aggregator is a class verl looks up by name when a
step starts, as the critic's ``TrainingWorker`` is; verl's own class stays in
``verl.trainer.ppo.v1.utils``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from rlmetrics.compat.verl.aggregator import MetricsAggregator
from rlmetrics.kinds import MetricState
from rlmetrics.state import TrackerState

UTILS_MODULE = "verl.trainer.ppo.v1.utils"
"""The module that defines verl's ``MetricsAggregator`` (left as verl made it)."""
TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_base"
"""The module whose ``PPOTrainer.step`` builds one ``MetricsAggregator`` a step, by the
name it imported from ``UTILS_MODULE``."""
AGGREGATOR = "MetricsAggregator"
STATE_KEY = "rlmetrics_state"
"""The worker's metrics key that carries its merged state (``<role>/`` on the driver)."""


class StepMetricsAggregator(MetricsAggregator):
    """verl's per-step ``MetricsAggregator``, exact, and merging the workers' states.

    An iteration's ``<prefix>rlmetrics_state`` entry (a ``TrackerState``) stands for
    every key its metrics report (named as verl's ``rename_dict`` names them: the
    prefix added unless the name has it): those keys' numbers are left out, and the
    states merge by their kinds. Every other key is reduced as
    ``rlmetrics.compat.verl.MetricsAggregator`` reduces it.
    """

    def add_step_metrics(
        self, metrics: Mapping[str, Any] | TrackerState, sample_count: int = 0
    ) -> None:
        """Record one iteration's metrics (see ``MetricsAggregator.add_step_metrics``)."""
        if isinstance(metrics, Mapping):
            metrics = with_states(metrics)
        super().add_step_metrics(metrics, sample_count)


def with_states(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``metrics`` with each carried state's metrics (as ``MetricState``s under the
    driver's names) in place of the state entry and of the numbers they stand for."""
    states = {
        key: value
        for key, value in metrics.items()
        if key.rsplit("/", 1)[-1] == STATE_KEY and isinstance(value, TrackerState)
    }
    carried: dict[str, MetricState] = {}
    covered: set[str] = set()  # the keys the states report: their names, derived keys
    for key, state in states.items():
        prefix = key[: -len(STATE_KEY)]
        renamed = {
            name if name.startswith(prefix) else prefix + name: metric
            for name, metric in state.metrics.items()
        }
        carried.update(renamed)
        covered.update(renamed)
        covered.update(TrackerState(renamed).compute())
    out = {k: v for k, v in metrics.items() if k not in states and k not in covered}
    out.update(carried)
    return out


def install() -> None:
    """Point the name ``trainer_base`` builds each step's aggregator from at
    ``StepMetricsAggregator`` (idempotent). Called right after ``trainer_base`` is
    imported; verl's own class in ``UTILS_MODULE`` is left alone, for code that builds
    one itself."""
    setattr(sys.modules[TRAINER_MODULE], AGGREGATOR, StepMetricsAggregator)


def uninstall() -> None:
    """verl's own ``MetricsAggregator`` in ``trainer_base`` again."""
    trainer_base = sys.modules.get(TRAINER_MODULE)
    if trainer_base is not None and getattr(trainer_base, AGGREGATOR) is StepMetricsAggregator:
        setattr(trainer_base, AGGREGATOR, getattr(sys.modules[UTILS_MODULE], AGGREGATOR))
