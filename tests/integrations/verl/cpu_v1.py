"""verl 0.9.1's V1 trainers on the CPU (test support, not shipped).

``python3 -m verl.trainer.main_ppo`` runs verl's ``TaskRunnerV1`` as a Ray actor: it
initialises TransferQueue, looks the trainer class up by ``trainer.v1.trainer_mode``
(``get_trainer_cls``), builds it, calls ``init()``, builds the agent loop manager and
calls ``fit``. The tests run that same actor. One thing stops it on the CPU:
``PPOTrainer._init_resource_pool_mgr`` builds verl's ``ResourcePoolManager``, which asks
Ray for GPUs. So this module registers, through verl's ``register_trainer``, a subclass
of each V1 trainer (``cpu_sync``, ``cpu_colocate_async``, ``cpu_separate_async``) that
makes the same pools on CPUs (``cpu_verl.cpu_resource_pool_manager_class``). verl
refuses to register a second class under an existing name, and it branches on the
mode's name (the replay buffer, the prompt refill, TransferQueue's checkpoint), so each
subclass sets the config's mode back to verl's (``sync``, ...) before verl reads it:
the trainer then runs as verl's own mode.

Each subclass sorts a step's samples by prompt before verl balances them over the
ranks (so runs that differ in their micro-batches train on the same mini-batches), and
keeps what every iteration of a step logged (``iterations``: the iteration's metric
dict before verl's ``MetricsAggregator`` merges it, its sample count and its response
tokens read from TransferQueue), for the tests to reduce themselves.

The runner imports this module through ``VERL_USE_EXTERNAL_MODULES`` (inside its
``import verl``, after ``cpu_verl_worker``), as the trainer workers import
``cpu_rollout``.
"""

from __future__ import annotations

from typing import Any

import transfer_queue as tq
from cpu_verl import cpu_resource_pool_manager_class
from omegaconf import open_dict
from verl.trainer.ppo.v1 import (
    PPOTrainer,
    PPOTrainerColocateAsync,
    PPOTrainerSeparateAsync,
    PPOTrainerSync,
    register_trainer,
)

PREFIX = "cpu_"
"""A CPU trainer's mode is verl's, with this prefix."""


class CPUPools:
    """What every CPU trainer adds to verl's: CPU pools, verl's mode name, and the
    record of each iteration."""

    def __init__(self, config: Any) -> None:
        with open_dict(config):
            config.trainer.v1.trainer_mode = config.trainer.v1.trainer_mode[len(PREFIX) :]
        self.iterations: list[dict[str, Any]] = []
        super().__init__(config)

    def _init_resource_pool_mgr(self) -> None:
        super()._init_resource_pool_mgr()
        manager = self.resource_pool_manager
        self.resource_pool_manager = cpu_resource_pool_manager_class()(
            resource_pool_spec=manager.resource_pool_spec, mapping=manager.mapping
        )

    def _balance_batch(self, batch: Any, metrics: dict, *args: Any, **kwargs: Any) -> Any:
        """verl's balance of the batch over the ranks, from the batch in prompt order:
        the replay buffer hands a step's samples in the order they finished, which
        varies from run to run, and verl's balance (so each rank's rows and mini-batches)
        depends on it. Runs that differ in their micro-batches then train on the same
        mini-batches, as the V0 fit's sequential sampler makes them."""
        prompts = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=["prompts"]
        )["prompts"].unbind()
        batch.reorder(sorted(range(len(prompts)), key=lambda i: prompts[i].tolist()))
        return super()._balance_batch(batch, metrics, *args, **kwargs)

    def _step_once(self, metrics: dict, timing_raw: dict, sample_batch_size: int) -> Any:
        batch = super()._step_once(metrics, timing_raw, sample_batch_size)
        mask = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=["response_mask"]
        )["response_mask"]
        mask = mask.values() if mask.is_nested else mask
        self.iterations.append(
            {
                "step": self.global_steps,
                "metrics": dict(metrics),
                "samples": sum(not tag.get("is_padding", False) for tag in batch.tags),
                "response_tokens": int(mask.sum()),
            }
        )
        return batch


def _register(name: str, trainer: type[PPOTrainer]) -> None:
    """Register verl's ``trainer`` (mode ``name``) on CPU pools as ``cpu_<name>``."""
    register_trainer(PREFIX + name)(type(f"CPU{trainer.__name__}", (CPUPools, trainer), {}))


_register("sync", PPOTrainerSync)
_register("colocate_async", PPOTrainerColocateAsync)
_register("separate_async", PPOTrainerSeparateAsync)
