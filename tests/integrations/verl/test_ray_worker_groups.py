"""verl 0.9.1's single controller on the CPU: its Ray worker groups, exact with rlmetrics installed.

What a verl user runs, minus the rollout: verl's ``RayResourcePool(use_gpu=False)``,
``RayClassWithInitArgs`` and ``RayWorkerGroup`` start 2 Ray worker processes, each
holding an ``ActorRolloutRefWorker(role="actor")`` and a critic ``TrainingWorker``
colocated as ``RayPPOTrainer.init_workers`` colocates them (``create_colocated_worker_cls``,
``spawn``), initialised from verl's generated trainer config (``scenarios.trainer_config``).
The driver then runs ``RayPPOTrainer``'s own ``_update_actor`` and ``_update_critic`` on
one 16-sequence DataProto per split and reduces what comes back with verl's
``reduce_metrics``, as ``RayPPOTrainer.fit`` does. The split travels in the batch's
``meta_info`` (verl's workers take ``micro_batch_size_per_gpu`` / ``use_dynamic_bsz`` /
``max_token_len_per_gpu`` from the data before their config), so one set of workers
serves every split.

Two worker groups run side by side on one local Ray: one as rlmetrics installs itself
(the ``verl.plugins`` entry point, loaded by ``import verl`` in each worker), one with
``VERL_USE_EXTERNAL_PLUGINS=none`` in its workers' environment (verl's off switch). The
driver has the integration off and hands verl's own classes to Ray, so only the workers'
plugin can switch them; the workers report what they built. The CPU platform reaches the
workers through verl's ``VERL_USE_EXTERNAL_MODULES`` (``cpu_verl_worker``).

The truth is a numpy computation over the whole batch (``verl_formulas``), from the
log-probs, entropies and values the same workers compute with verl's forward passes
(``_compute_old_log_prob``, ``_compute_values``); the learning rate is 0, so every
update sees those weights.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from functools import partial
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from scenarios import (
    ACTOR_METRICS,
    CRITIC_METRICS,
    critic_worker_config,
    make_batch,
    set_critic,
    trainer_config,
    worker_facts,
)

from verl_formulas import update_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

WORLD_SIZE = 2
ROWS = 16
"""Sequences in the batch: 8 per worker, so micro-batches of 8 are one per worker."""
SEED = 3
"""A batch whose two halves (the workers' shares) differ in response tokens."""
RAY_SPLITS: dict[str, dict[str, Any]] = {
    "micro8": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 8},
    "micro2": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2},
    "micro1": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 1},
    "dynamic16": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 16},
    "dynamic24": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 24},
}
TOLERANCE = 1e-6
DRIFT = 1e-3
STEP_METRICS = ("actor/grad_norm", "critic/grad_norm")
"""Not a function of the forward pass: compared with the split of one micro-batch per
worker (``micro8``) instead of numpy."""
DRIFTING = (
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/pg_clipfrac_lower",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
)
"""verl's means of micro-batch (and worker) means."""
STABLE = tuple(n for n in (*ACTOR_METRICS, *CRITIC_METRICS) if n not in DRIFTING)
WORKER_MODULE = "cpu_verl_worker"
EXACT_WORKER = "rlmetrics.integrations.verl.worker.ExactTrainingWorker"
VERL_WORKER = "verl.workers.engine_workers.TrainingWorker"
VARIANTS = {"exact": {}, "verl": {"VERL_USE_EXTERNAL_PLUGINS": "none"}}
"""Worker environments beyond the CPU module: rlmetrics' plugin as installed, and off."""


def ray_trainer_config(model_path: str) -> Any:
    """verl's generated trainer config for this batch: actor and critic on the CPU, one
    mini-batch of ROWS sequences, one response per prompt."""
    from omegaconf import open_dict

    config = trainer_config(os.path.join(model_path, "actor"))
    set_critic(config, os.path.join(model_path, "critic"))
    with open_dict(config):
        config.actor_rollout_ref.actor.ppo_mini_batch_size = ROWS
        config.actor_rollout_ref.rollout.n = 1
        config.critic.ppo_mini_batch_size = ROWS
    return config


def start_workers(config: Any, worker_env: dict[str, str]) -> SimpleNamespace:
    """WORLD_SIZE colocated actor+critic processes, set up as ``RayPPOTrainer.init_workers``
    sets them up; a namespace that verl's driver methods accept as their ``self``."""
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.single_controller.ray.base import create_colocated_worker_cls
    from verl.workers import engine_workers
    from verl.workers.utils.losses import value_loss as verl_value_loss

    worker_config, critic_config = critic_worker_config(config)
    classes = {
        "actor": RayClassWithInitArgs(
            cls=ray.remote(engine_workers.ActorRolloutRefWorker),
            config=config.actor_rollout_ref,
            role="actor",
        ),
        "critic": RayClassWithInitArgs(
            cls=ray.remote(engine_workers.TrainingWorker), config=worker_config
        ),
    }
    pool = RayResourcePool(process_on_nodes=[WORLD_SIZE], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=create_colocated_worker_cls(class_dict=classes),
        worker_env=worker_env,
    )
    groups = group.spawn(prefix_set=classes.keys())
    return SimpleNamespace(
        config=config,
        group=group,
        actor_rollout_wg=groups["actor"],
        critic_wg=groups["critic"],
        distillation_config=None,
        critic_loss=partial(verl_value_loss, config=critic_config),
    )


def init_workers(trainer: SimpleNamespace) -> None:
    """The critic's reset and loss, then the actor's models, in ``init_workers``' order."""
    trainer.critic_wg.reset()
    trainer.critic_wg.set_loss_fn(trainer.critic_loss)
    trainer.actor_rollout_wg.init_model()


def facts(trainer: SimpleNamespace) -> list[dict[str, Any]]:
    """Each worker process's own report (``scenarios.worker_facts``)."""
    import ray

    calls = [w.__ray_call__.remote(worker_facts) for w in trainer.group.workers]
    return ray.get(calls)


def data_proto(trainer: SimpleNamespace, batch: Any, **split: Any) -> Any:
    """The batch as ``RayPPOTrainer.fit`` holds it after the rollout (its ``meta_info``:
    the temperature and each sequence's token count), plus the split."""
    from verl import DataProto

    meta = {
        "temperature": trainer.config.actor_rollout_ref.rollout.temperature,
        "global_token_num": batch["attention_mask"].sum(-1).tolist(),
        **split,
    }
    return DataProto.from_dict(tensors=dict(batch.items()), meta_info=meta)


def updates(trainer: SimpleNamespace, batch: Any) -> dict[str, dict[str, float]]:
    """Per split: what ``RayPPOTrainer.fit`` logs from ``_update_critic`` and
    ``_update_actor`` (``reduce_metrics`` of their metrics), actor and critic together."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils.metric import reduce_metrics

    out = {}
    for name, split in RAY_SPLITS.items():
        critic = RayPPOTrainer._update_critic(trainer, data_proto(trainer, batch, **split))
        actor = RayPPOTrainer._update_actor(trainer, data_proto(trainer, batch, **split))
        logged = reduce_metrics(critic.meta_info["metrics"]) | reduce_metrics(
            actor.meta_info["metrics"]
        )
        out[name] = {k: float(v) for k, v in logged.items()}
    return out


def whole_batch_truth(trainer: SimpleNamespace, batch: Any) -> dict[str, float]:
    """The update metrics of one micro-batch holding the whole batch, in numpy, from the
    workers' forward passes (verl's driver methods)."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    forward, _ = RayPPOTrainer._compute_old_log_prob(trainer, data_proto(trainer, batch))
    values = RayPPOTrainer._compute_values(trainer, data_proto(trainer, batch))

    def array(tensor: Any) -> np.ndarray:
        return tensor.double().numpy()

    actor = trainer.config.actor_rollout_ref.actor
    truth = update_metrics(
        old=array(batch["old_log_probs"]),
        logp=array(forward.batch["old_log_probs"]),
        adv=array(batch["advantages"]),
        entropy=array(forward.batch["entropys"]),
        ref=array(batch["ref_log_prob"]),
        vpreds=array(values.batch["values"]),
        values=array(batch["values"]),
        returns=array(batch["returns"]),
        m=batch["response_mask"].bool().numpy(),
        low=actor.clip_ratio_low,
        high=actor.clip_ratio_high,
        c=actor.clip_ratio_c,
        kl_name=actor.kl_loss_type,
        clip=trainer.config.critic.cliprange_value,
    )
    return truth | {"actor/lr": 0.0, "critic/lr": 0.0}


@pytest.fixture(scope="module")
def runs(model_path: str, verl_ray: None) -> Iterator[dict[str, Any]]:
    """Both worker groups' facts and logged metrics, and the truth; also written as JSON
    to $RLMETRICS_VERL_RESULTS_DIR when set (the numbers docs/verl.md quotes). The
    workers are ended before the other modules run."""
    import ray

    import rlmetrics.integrations.verl as integration

    was_enabled = integration.is_enabled()
    integration.disable()  # the driver hands verl's own classes to Ray
    trainers: dict[str, SimpleNamespace] = {}
    try:
        config = ray_trainer_config(model_path)
        env = {"VERL_USE_EXTERNAL_MODULES": WORKER_MODULE}
        for name, extra in VARIANTS.items():
            trainers[name] = start_workers(config, env | extra)
        for trainer in trainers.values():
            init_workers(trainer)
        batch = make_batch(seed=SEED, rows=ROWS)
        from verl.workers import engine_workers

        out: dict[str, Any] = {
            "driver_classes": [
                f"{c.__module__}.{c.__qualname__}"
                for c in (
                    engine_workers.TrainingWorker,
                    engine_workers.ActorRolloutRefWorker.actor_worker_cls,
                )
            ],
            "truth": whole_batch_truth(trainers["exact"], batch),
        }
        for name, trainer in trainers.items():
            out[name] = {"facts": facts(trainer), "logged": updates(trainer, batch)}
    finally:
        for trainer in trainers.values():
            for worker in trainer.group.workers:
                ray.kill(worker)
            for placement_group in trainer.group.resource_pool.pgs or ():
                ray.util.remove_placement_group(placement_group)
        if was_enabled:
            integration.enable()
    folder = os.environ.get("RLMETRICS_VERL_RESULTS_DIR")
    if folder:
        with open(os.path.join(folder, "ray_worker_groups.json"), "w") as f:
            json.dump(out, f, indent=1, sort_keys=True)
    yield out


def reference(runs: dict[str, Any], name: str) -> float:
    """The value a metric must take: numpy over the whole batch, or for a per-step metric
    the value of one micro-batch per worker with the integration on."""
    if name in STEP_METRICS:
        return runs["exact"]["logged"]["micro8"][name]
    return runs["truth"][name]


def differences(runs: dict[str, Any], variant: str, split: str) -> dict[str, float]:
    logged = runs[variant]["logged"][split]
    missing = [n for n in (*ACTOR_METRICS, *CRITIC_METRICS) if n not in logged]
    assert not missing, f"{variant}, {split}: {missing} not logged ({sorted(logged)})"
    return {n: abs(logged[n] - reference(runs, n)) for n in (*ACTOR_METRICS, *CRITIC_METRICS)}


def test_the_plugin_loaded_in_the_workers_through_verls_entry_point(runs: dict) -> None:
    """The driver passed verl's classes; the workers that import verl with plugins on
    built rlmetrics' subclass for the actor's update and for the critic, the others
    verl's own, and neither got the integration any other way."""
    assert runs["driver_classes"] == [VERL_WORKER, VERL_WORKER]
    for fact in runs["exact"]["facts"]:
        assert fact["integration_imported"], fact
        assert fact["actor_update_class"] == EXACT_WORKER, fact
        assert fact["critic_class"] == EXACT_WORKER, fact
        assert fact["platform"] == "cpu", fact
    for fact in runs["verl"]["facts"]:
        assert not fact["integration_imported"], fact
        assert fact["actor_update_class"] == VERL_WORKER, fact
        assert fact["critic_class"] == VERL_WORKER, fact
        assert fact["plugins_policy"] == "none", fact
    pids = [f["pid"] for v in VARIANTS for f in runs[v]["facts"]]
    assert len(set(pids)) == len(VARIANTS) * WORLD_SIZE


def beyond_tolerance(runs: dict[str, Any], variant: str, split: str, names: tuple) -> dict:
    """The metrics among ``names`` farther than TOLERANCE (relative above 1) from their
    reference, with their differences."""
    diff = differences(runs, variant, split)
    return {n: diff[n] for n in names if diff[n] > TOLERANCE * max(1.0, abs(reference(runs, n)))}


@pytest.mark.parametrize("split", list(RAY_SPLITS))
def test_every_update_metric_equals_the_whole_batch(runs: dict, split: str) -> None:
    wrong = beyond_tolerance(runs, "exact", split, (*ACTOR_METRICS, *CRITIC_METRICS))
    logged = runs["exact"]["logged"][split]
    assert not wrong, {n: (logged[n], reference(runs, n)) for n in wrong}


@pytest.mark.parametrize("split", list(RAY_SPLITS))
def test_without_the_plugin_verls_workers_drift(runs: dict, split: str) -> None:
    """The same workers with verl's plugins off log ratios that move with the split (so
    the test above can fail): more than DRIFT on at least one metric. One micro-batch
    per worker moves too: verl averages the two workers' means, and their halves of this
    batch hold 47 and 30 response tokens. What verl already gets right within one
    mini-batch (losses, grad norms, lr) equals the same references."""
    diff = differences(runs, "verl", split)
    assert max(diff[n] for n in DRIFTING) > DRIFT, f"{split}: verl's differences {diff}"
    assert not beyond_tolerance(runs, "verl", split, STABLE), diff
