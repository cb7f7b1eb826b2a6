"""``ExactRayPPOTrainer``: SkyRL's RayPPOTrainer with the exact workers and an exact step.

SkyRL's trainer runs a training step as a loop over epochs and mini-batches on the
driver and then averages the mini-batches' metric dicts with equal weights (its
``_execute_training_step``). This subclass changes two things, and nothing in how it
trains:

* ``build_models`` hands SkyRL the exact FSDP workers in place of its own;
* after SkyRL's loop, every worker's state of the step is merged on the driver (one Ray
  call per worker group and step) and replaces SkyRL's averages: each value is then the
  one a single mini-batch holding every update of the step would give, the learning
  rate is the one the step's last optimizer step applied, and ``grad_norm`` the mean over
  the step's optimizer steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ray
from skyrl.backends.skyrl_train.workers.fsdp import fsdp_worker
from skyrl.train.trainer import RayPPOTrainer
from skyrl.train.utils.trainer_utils import finalize_minibatch_rollout_logprob_diff_std

from rlmetrics.integrations.ray import compute_states
from rlmetrics.integrations.skyrl.worker import ExactCriticWorker, ExactPolicyWorker
from rlmetrics.state import TrackerState


def exact_step_metrics(
    reduced: Mapping[str, float], states: Sequence[TrackerState], replicas: Sequence[bool]
) -> dict[str, float]:
    """SkyRL's step dict ``reduced`` with every name the workers' ``states`` hold
    replaced by their merged value (``replicas``: the sequence-parallel copies, left
    out). The log-prob difference's std is rebuilt from the merged moments, as SkyRL
    rebuilds it from its averaged ones."""
    exact = compute_states(states, replicas=replicas)
    finalize_minibatch_rollout_logprob_diff_std(exact)
    return {**reduced, **exact}


def _exact_worker(given: Any, skyrl_worker: Any, exact_worker: Any, role: str) -> Any:
    """The exact worker in place of SkyRL's FSDP one; any other class is refused."""
    if given is skyrl_worker or given is exact_worker:
        return exact_worker
    raise ValueError(
        f"ExactRayPPOTrainer: the {role} worker must be SkyRL's FSDP {role} worker "
        f"(trainer.strategy='fsdp'), got {given!r}; rlmetrics has no exact version of it"
    )


class ExactRayPPOTrainer(RayPPOTrainer):
    """SkyRL's ``RayPPOTrainer`` whose logged policy and critic metrics are exact.

    Return it from ``BasePPOExp.get_trainer`` (see docs/skyrl.md); the constructor is
    SkyRL's.
    """

    def build_models(self, PolicyWorker: Any, CriticWorker: Any, RefWorker: Any) -> None:
        super().build_models(
            _exact_worker(PolicyWorker, fsdp_worker.PolicyWorker, ExactPolicyWorker, "policy"),
            _exact_worker(CriticWorker, fsdp_worker.CriticWorker, ExactCriticWorker, "critic"),
            RefWorker,
        )

    def _execute_training_step(self, model: str, data: Any) -> dict[str, float]:
        reduced = super()._execute_training_step(model, data)
        group = self.policy_model if model == "policy" else self.critic_model
        states = ray.get(group.async_run_ray_method("pass_through", "take_step_metrics_state"))
        replicas = [not info.rank.is_collection_dp_rank() for info in group.actor_infos]
        return exact_step_metrics(reduced, states, replicas)
