"""verl 0.9.1's default trainer, V1 ``sync``, on the CPU: its logged metrics with and
without rlmetrics.

``python3 -m verl.trainer.main_ppo`` with verl's defaults (``trainer.use_v1=true``,
``trainer.v1.trainer_mode=sync``) runs verl's ``TaskRunnerV1`` as a Ray actor, which
initialises TransferQueue, builds ``PPOTrainerSync`` (``init()``: resource pools, the
colocated actor and critic workers, the rollout replicas, the naive checkpoint engine,
the reward loop), then the agent loop manager (``AgentLoopManagerTQ``), and runs
``fit``. The test runs that actor, with its environment given as Ray's ``runtime_env``
(its children, the trainer workers among them, inherit it):

* ``cpu_verl_worker`` and ``cpu_rollout`` as in ``test_trainer_fit.py`` (the CPU
  platform and engines, the ``hf_cpu`` rollout), and ``cpu_v1``: the trainer on CPU
  resource pools, registered with verl's ``register_trainer`` as ``cpu_sync``; it runs
  as verl's ``sync`` (see ``cpu_v1``);
* rlmetrics installed (its plugin loads in every process that imports verl), or
  ``VERL_USE_EXTERNAL_PLUGINS=none`` (verl alone, in the runner and all its children).

The experiment is ``test_trainer_fit.py``'s, on the same files and config: the actor's
micro-batch of 8 sequences (a worker's whole share of a mini-batch) against 2, on the
same rollouts; the step's two mini-batches, so the second sees moved weights. Slow (4
runs of about a minute on 2 cores): part of ``make test-verl``;
``RLMETRICS_VERL_FIT=0`` skips it with the V0 fit.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import test_trainer_fit as v0
from test_trainer_fit import fit_files  # noqa: F401  (the fixture: models, data, reward)

pytestmark = v0.pytestmark

STEPS = 1
"""One step: its two mini-batches already update the weights between them."""
MODULES = "cpu_verl_worker,cpu_rollout,cpu_v1"
EXACT = "rlmetrics.integrations.verl.worker.ExactTrainingWorker"
VERL = "verl.workers.engine_workers.TrainingWorker"


def v1_config(files: v0.FitFiles, micro: int, log_path: str, mode: str, steps: int) -> Any:
    """``test_trainer_fit.fit_config`` for verl's V1 trainer in ``mode`` (``cpu_`` +
    verl's mode), ``steps`` steps; TransferQueue with one storage unit (each holds a
    Ray CPU)."""
    from omegaconf import open_dict

    config = v0.fit_config(files, micro, log_path)
    with open_dict(config):
        config.trainer.use_v1 = True
        config.trainer.v1.trainer_mode = mode
        config.trainer.total_training_steps = steps
        config.transfer_queue.backend.SimpleStorage.num_data_storage_units = 1
    return config


def runner_report(runner: Any) -> dict[str, Any]:
    """What the trainer in ``TaskRunnerV1`` built and recorded (run in the runner by
    ``__ray_call__``): its workers' classes, the rollout servers' counts, each
    iteration's metrics (``cpu_v1``) and the aggregator class verl's step used."""
    import ray
    from verl.trainer.ppo.v1 import trainer_base

    trainer = runner.trainer
    aggregator = trainer_base.MetricsAggregator
    return {
        "facts": ray.get(
            [w.__ray_call__.remote(v0.worker_facts) for w in trainer.actor_rollout_wg.workers]
        ),
        "servers": [
            ray.get(server.stats.remote())
            for replica in trainer.llm_server_manager.rollout_replicas
            for server in replica.servers
        ],
        "iterations": trainer.iterations,
        "aggregator": f"{aggregator.__module__}.{aggregator.__qualname__}",
    }


def end_runner(runner: Any) -> None:
    """End the trainer's actors and placement groups (run in the runner)."""
    if getattr(runner, "trainer", None) is not None:
        v0.end_actors(runner.trainer)


def run_v1(
    config: Any, log_path: str, variant: str, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """verl's ``TaskRunnerV1.run`` on ``config``, with rlmetrics (``variant`` "exact")
    or without ("verl"); what verl's file logger wrote and the runner's report."""
    import ray
    from verl.trainer.main_ppo import TaskRunnerV1

    runner_env = {
        "VERL_USE_EXTERNAL_MODULES": MODULES,
        "VERL_FILE_LOGGER_PATH": log_path,
        **(env or {}),
    }
    if variant == "verl":
        runner_env["VERL_USE_EXTERNAL_PLUGINS"] = "none"
    runner = TaskRunnerV1.options(runtime_env={"env_vars": runner_env}).remote()
    try:
        ray.get(runner.run.remote(config))
        report = ray.get(runner.__ray_call__.remote(runner_report))
    finally:
        try:
            ray.get(runner.__ray_call__.remote(end_runner))
        finally:
            ray.kill(runner)
    with open(log_path) as f:
        report["logged"] = [json.loads(line) for line in f if line.strip()]
    return report


@pytest.fixture(scope="module")
def v1_fits(
    fit_files: v0.FitFiles,  # noqa: F811
    verl_ray: None,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict]:
    """Every variant's V1 ``sync`` run at every micro-batch size; also written as JSON
    to $RLMETRICS_VERL_RESULTS_DIR when set (the numbers docs/verl.md quotes)."""
    folder = str(tmp_path_factory.mktemp("v1_logs"))
    out: dict[str, Any] = {}
    for variant in v0.VARIANTS:
        for micro in v0.MICRO:
            name = f"{variant}_micro{micro}"
            log_path = os.path.join(folder, f"{name}.jsonl")
            config = v1_config(fit_files, micro, log_path, "cpu_sync", STEPS)
            out[name] = run_v1(config, log_path, variant)
    results = os.environ.get("RLMETRICS_VERL_RESULTS_DIR")
    if results:
        with open(os.path.join(results, "trainer_v1.json"), "w") as f:
            json.dump({k: {"logged": v["logged"]} for k, v in out.items()}, f, indent=1)
    yield out


def test_v1_runs_its_steps_through_transfer_queue_and_the_cpu_rollout(v1_fits: dict) -> None:
    for name, run in v1_fits.items():
        logged = v0.steps(run)
        assert [row["training/global_step"] for row in logged] == list(range(1, STEPS + 1)), name
        assert len(run["iterations"]) == STEPS, name  # sync: one iteration a step
        (server,) = run["servers"]
        assert server["requests"] == v0.PROMPTS * STEPS, (name, server)
        assert server["global_steps"] == STEPS, (name, server)
        for row in logged:
            assert row["training/rollout_probs_diff_max"] < 1e-6, (name, row)


def test_the_plugin_builds_the_exact_workers_and_aggregator_only_with_rlmetrics(
    v1_fits: dict,
) -> None:
    for micro in v0.MICRO:
        exact, verl = v1_fits[f"exact_micro{micro}"], v1_fits[f"verl_micro{micro}"]
        for fact in exact["facts"]:
            assert fact["integration_imported"], fact
            assert (fact["actor_update_class"], fact["critic_class"]) == (EXACT, EXACT), fact
        for fact in verl["facts"]:
            assert not fact["integration_imported"], fact
            assert (fact["actor_update_class"], fact["critic_class"]) == (VERL, VERL), fact
        assert exact["aggregator"].endswith("async_steps.StepMetricsAggregator")
        assert verl["aggregator"] == "verl.trainer.ppo.v1.utils.MetricsAggregator"


def test_the_runs_train_the_same(v1_fits: dict) -> None:
    """The same rollouts, scores and updates in every run (gradient norms, the actor's
    entropy): only the split and the reduction of the metrics differ."""
    exactly = ("critic/score/mean", "response_length/mean", "prompt_length/mean")
    close = ("actor/grad_norm", "critic/grad_norm", "actor/entropy", "critic/values/mean")
    reference = v0.steps(v1_fits["exact_micro8"])
    for name, run in v1_fits.items():
        for row, ref in zip(v0.steps(run), reference, strict=True):
            assert {n: row[n] for n in exactly} == {n: ref[n] for n in exactly}, name
            far = {n: (row[n], ref[n]) for n in close if abs(row[n] - ref[n]) > v0.TOLERANCE}
            assert not far, (name, far)


def test_with_rlmetrics_the_v1_update_metrics_agree_across_micro_batches(v1_fits: dict) -> None:
    diff = v0.differences(v1_fits, "exact")
    assert max(diff.values()) < v0.TOLERANCE, diff


def test_without_rlmetrics_verls_v1_clip_fraction_drifts(v1_fits: dict) -> None:
    diff = v0.differences(v1_fits, "verl")
    assert diff["actor/pg_clipfrac"] > v0.DRIFT, diff
