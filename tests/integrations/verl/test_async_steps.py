"""verl 0.9.1's V1 async modes: a step of several iterations, reported as one batch.

verl's ``PPOTrainer.step`` (``verl.trainer.ppo.v1.trainer_base``; ``colocate_async``
and ``separate_async`` do not override it) runs ``parameter_sync_step`` iterations and
merges their metric dicts with the ``MetricsAggregator`` it looks up by name. With
rlmetrics, that is ``StepMetricsAggregator``, which merges the states the workers send
(``<role>/rlmetrics_state``) by their kinds. Three checks, each with verl's own
aggregator on the same iterations as its drift control:

* the real ``step`` of ``PPOTrainerSeparateAsync`` (verl's default of 4 iterations),
  fed iterations as verl's driver receives them from 2 ranks (the workers' metrics
  through verl's ``rename_dict`` and ``reduce_metrics``), against numpy over the
  step's tokens;
* ``colocate_async`` run end to end on the CPU (``TaskRunnerV1``, as in
  ``test_trainer_v1.py``) with 2 iterations a step, against each iteration's logged
  values weighted by its response tokens (read from TransferQueue);
* the per-source restriction of ``RLMETRICS_VERL_DETAIL`` on the jagged masks the V1
  trainers hand the workers.

``separate_async`` itself stops on the CPU before ``fit`` (docs/verl.md, "The async
modes"): its standalone rollout needs a checkpoint engine other than verl's naive one,
and verl 0.9.1's others move weights over NCCL, HCCL, NIXL or Mooncake.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import test_trainer_fit as v0
import test_trainer_v1 as v1
import torch
from test_trainer_fit import fit_files  # noqa: F401  (the fixture: models, data, reward)

import rlmetrics.integrations.verl as integration
from rlmetrics import Tracker, TrackerState

RANKS = 2
DRIFT = 1e-3
ITERATION_DRIFT = 1e-7
"""verl's least drift in the end-to-end run, whose two iterations hold similar token
counts (docs/verl.md has the numbers); the test with known iterations asserts DRIFT."""


# -- the per-source restriction on a jagged mask ------------------------------------------
def test_a_source_restriction_keeps_a_jagged_masks_width() -> None:
    """verl's ``value_loss`` pads the micro-batch with TensorDict's ``to_padded_tensor``;
    the restricted mask must pad to the rows' longest length, as the mask does."""
    from tensordict import TensorDict

    from rlmetrics.integrations.verl.detail import restrict_to_rows

    lengths = (3, 5, 2)
    jagged = {
        key: torch.nested.as_nested_tensor([torch.ones(n) for n in lengths], layout=torch.jagged)
        for key in ("response_mask", "values")
    }
    data = TensorDict(jagged, batch_size=[3])
    part = restrict_to_rows(data, torch.tensor([True, False, True]))
    padded = part.select("values", "response_mask").to_padded_tensor()["response_mask"]
    assert padded.tolist() == [[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]]


# -- the real step of separate_async, fed known iterations ---------------------------------
def worker_iteration(seed: int, optimizer_steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One iteration of an actor update on RANKS ranks, as the driver receives it: the
    metrics of DP rank 0's ``ExactTrainingWorker`` (merged values and their state) through
    verl's ``rename_dict`` and ``reduce_metrics``; and its raw numbers (per rank: the
    clipped flags of its response tokens, its seconds in the engine; the lr, the grad
    norms)."""
    from verl.utils.metric import reduce_metrics
    from verl.utils.py_functional import rename_dict

    from rlmetrics.integrations.verl.worker import StepState

    rng = np.random.default_rng(seed)
    raw: dict[str, Any] = {
        "clipped": [
            rng.random(rng.integers(40, 400)) < rng.uniform(0.05, 0.6) for _ in range(RANKS)
        ],
        "seconds": rng.uniform(1.0, 3.0, RANKS),
        "lr": float(rng.uniform(0.01, 0.1)),
        "grad_norms": rng.uniform(0.5, 2.0, optimizer_steps),
    }
    states = []
    for rank in range(RANKS):
        tracker = Tracker()
        tracker.mean("pg_clipfrac", torch.from_numpy(raw["clipped"][rank].astype(np.float64)))
        tracker.last("lr", raw["lr"])
        for norm in raw["grad_norms"]:
            tracker.mean("grad_norm", float(norm))
        seconds = np.zeros(RANKS)
        seconds[rank] = raw["seconds"][rank]
        tracker.log(
            "actor/update_time_s",
            seconds,
            (np.arange(RANKS) == rank) * 1.0,
            kind=f"rank_time@{RANKS}",
        )
        states.append(tracker.state())
    state = TrackerState.merge_all(states)  # what compute_state over the group gives
    output: dict[str, Any] = {name: [value] for name, value in state.compute().items()}
    output.update({"rlmetrics_state": StepState(state), "mfu": [0.1], "loss": [0.5]})
    metrics = rename_dict(output, "actor/")
    metrics["perf/mfu/actor"] = metrics.pop("actor/mfu")
    return reduce_metrics(metrics), raw


def run_step(trainer_cls: type, iterations: list[dict[str, Any]], samples: int) -> dict:
    """verl's ``trainer_cls.step`` on a stand-in trainer whose ``_step_once`` logs the
    given iterations' metrics (one each, ``samples`` samples), as verl's loop calls it."""
    from omegaconf import OmegaConf
    from transfer_queue import KVBatchMeta

    class Replay:
        config = OmegaConf.create({"data": {"train_batch_size": samples * len(iterations)}})
        parameter_sync_step = len(iterations)
        queue = iter(iterations)
        calls = 0

        def prepare_step(self) -> dict:
            return {}

        def _step_once(self, metrics: dict, timing_raw: dict, sample_batch_size: int) -> Any:
            assert sample_batch_size == samples
            metrics.update(next(self.queue))
            self.calls += 1
            keys = [f"k{self.calls}-{i}" for i in range(samples)]  # unique in the step
            return KVBatchMeta(partition_id="train", keys=keys, tags=[{}] * samples)

    metrics: dict[str, Any] = {}
    trainer_cls.step(Replay(), metrics, {})
    return metrics


@pytest.fixture(scope="module")
def separate_async_step() -> dict[str, Any]:
    """The default separate_async step (verl's ``parameter_sync_step``) over the same
    iterations, with rlmetrics' aggregator and with verl's own; and the raw numbers."""
    from scenarios import trainer_config
    from verl.trainer.ppo.v1 import PPOTrainer, PPOTrainerSeparateAsync, trainer_base

    assert PPOTrainerSeparateAsync.step is PPOTrainer.step  # separate_async runs verl's step
    count = trainer_config("unused").trainer.v1.separate_async.parameter_sync_step
    assert count == 4
    pairs = [worker_iteration(seed, optimizer_steps=1 + seed % 2) for seed in range(count)]
    iterations, raw = [p[0] for p in pairs], [p[1] for p in pairs]
    was_enabled = integration.is_enabled()
    try:
        integration.enable()
        exact = run_step(PPOTrainerSeparateAsync, iterations, samples=16)
        integration.disable()
        assert trainer_base.MetricsAggregator.__module__ == "verl.trainer.ppo.v1.utils"
        verl = run_step(PPOTrainerSeparateAsync, iterations, samples=16)
    finally:
        integration.enable() if was_enabled else integration.disable()
    return {"exact": exact, "verl": verl, "raw": raw}


def step_truth(raw: list[dict[str, Any]]) -> dict[str, float]:
    """numpy over the whole step: every token's flag, every optimizer step's norm, each
    rank's seconds summed over the iterations, the last iteration's lr."""
    flags = np.concatenate([np.concatenate(r["clipped"]) for r in raw])
    per_rank = np.sum([r["seconds"] for r in raw], axis=0)
    return {
        "actor/pg_clipfrac": float(flags.mean()),
        "actor/lr": raw[-1]["lr"],
        "actor/grad_norm": float(np.concatenate([r["grad_norms"] for r in raw]).mean()),
        "actor/update_time_s": float(per_rank.max()),
        "actor/update_time_s/min": float(per_rank.min()),
        "actor/update_time_s/mean": float(per_rank.mean()),
        "actor/update_time_s/slowest_rank": float(per_rank.argmax()),
    }


def test_the_separate_async_step_is_the_steps_batch_with_rlmetrics(separate_async_step) -> None:
    exact, truth = separate_async_step["exact"], step_truth(separate_async_step["raw"])
    assert {k: exact[k] for k in truth} == pytest.approx(truth, rel=1e-12, abs=1e-12)
    assert "actor/rlmetrics_state" not in exact
    assert exact["actor/loss"] == 0.5 and exact["perf/mfu/actor"] == pytest.approx(0.1)


def test_verls_own_step_drifts_from_the_steps_batch(separate_async_step) -> None:
    verl, truth = separate_async_step["verl"], step_truth(separate_async_step["raw"])
    assert abs(verl["actor/pg_clipfrac"] - truth["actor/pg_clipfrac"]) > DRIFT
    assert abs(verl["actor/grad_norm"] - truth["actor/grad_norm"]) > DRIFT  # steps unweighted
    assert abs(verl["actor/update_time_s"] - truth["actor/update_time_s"]) > DRIFT
    assert "actor/rlmetrics_state" not in verl  # verl skips the state entry


def test_one_iteration_reports_the_workers_values_bit_for_bit() -> None:
    """``sync`` and ``colocate_async`` (one iteration a step by default): the step logs
    what the workers computed, unchanged."""
    from verl.trainer.ppo.v1 import PPOTrainerSync

    iteration, _ = worker_iteration(7, optimizer_steps=2)
    was_enabled = integration.is_enabled()
    try:
        integration.enable()
        step = run_step(PPOTrainerSync, [iteration], samples=16)
    finally:
        integration.enable() if was_enabled else integration.disable()
    expected = {k: v for k, v in iteration.items() if k != "actor/rlmetrics_state"}
    assert {k: step[k] for k in expected} == expected


# -- colocate_async, end to end on the CPU --------------------------------------------------
ASYNC_ITERATIONS = 2
"""colocate_async's ``parameter_sync_step`` here (verl's default is 1): a step of two
iterations of 16 prompts."""
ASYNC_MINI_BATCH = 8
"""The actor's mini-batch in the async run: two optimizer steps an iteration."""
TOKEN_MEANS = ("actor/pg_clipfrac", "actor/ppo_kl", "critic/vf_clipfrac", "critic/vpred_mean")


def fit_test(test: Any) -> Any:
    """The V0 fit's marks (slow; skipped with ``RLMETRICS_VERL_FIT=0``)."""
    for mark in v0.pytestmark:
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def colocate_async_run(
    fit_files: v0.FitFiles,  # noqa: F811
    verl_ray: None,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict]:
    """One ``colocate_async`` step of ASYNC_ITERATIONS iterations with rlmetrics (and
    its slowest-rank timing, ``RLMETRICS_VERL_DETAIL``), on the V0 fit's files."""
    from omegaconf import open_dict

    folder = str(tmp_path_factory.mktemp("async_logs"))
    log_path = os.path.join(folder, "colocate_async.jsonl")
    config = v1.v1_config(fit_files, 8, log_path, "cpu_colocate_async", steps=1)
    with open_dict(config):
        config.trainer.v1.colocate_async.parameter_sync_step = ASYNC_ITERATIONS
        # two mini-batches an iteration, so the second sees moved weights (the first
        # sees the weights its old log-probs came from: nothing is clipped)
        config.actor_rollout_ref.actor.ppo_mini_batch_size = ASYNC_MINI_BATCH
        config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = ASYNC_MINI_BATCH // RANKS
    run = v1.run_v1(config, log_path, "exact", {"RLMETRICS_VERL_DETAIL": "1"})
    results = os.environ.get("RLMETRICS_VERL_RESULTS_DIR")
    if results:
        iterations = [
            {
                **it,
                "metrics": {
                    k: float(v)
                    for k, v in it["metrics"].items()
                    if isinstance(v, int | float | np.number)
                },
            }
            for it in run["iterations"]
        ]
        with open(os.path.join(results, "colocate_async.json"), "w") as f:
            json.dump({"logged": run["logged"], "iterations": iterations}, f, indent=1)
    yield run


def by_tokens(run: dict[str, Any], name: str) -> float:
    """The iterations' logged ``name`` weighted by their response tokens."""
    iterations = run["iterations"]
    tokens = np.array([it["response_tokens"] for it in iterations], dtype=np.float64)
    values = np.array([float(it["metrics"][name]) for it in iterations])
    return float((values * tokens).sum() / tokens.sum())


def rank_seconds(run: dict[str, Any], role: str) -> np.ndarray:
    """Each rank's seconds summed over the iterations, from each iteration's slowest and
    fastest rank (2 ranks: together they are both)."""
    totals = np.zeros(RANKS)
    for iteration in run["iterations"]:
        metrics, name = iteration["metrics"], f"{role}/update_time_s"
        slowest = int(metrics[f"{name}/slowest_rank"])
        totals[slowest] += metrics[name]
        totals[1 - slowest] += metrics[f"{name}/min"]
    return totals


def verl_aggregate(run: dict[str, Any]) -> dict[str, Any]:
    """verl's own ``MetricsAggregator`` over the run's iterations (the states skipped)."""
    from verl.trainer.ppo.v1 import utils

    aggregator = utils.MetricsAggregator()  # rlmetrics leaves verl's class where it is
    for iteration in run["iterations"]:
        aggregator.add_step_metrics(iteration["metrics"], sample_count=iteration["samples"])
    return aggregator.get_aggregated_metrics()


@fit_test
def test_colocate_async_logs_its_step_as_one_batch(colocate_async_run: dict) -> None:
    run = colocate_async_run
    assert len(run["iterations"]) == ASYNC_ITERATIONS
    assert run["aggregator"].endswith("async_steps.StepMetricsAggregator")
    (row,) = v0.steps(run)
    for name in TOKEN_MEANS:
        assert abs(row[name] - by_tokens(run, name)) < 1e-9, name
    assert row["actor/lr"] == run["iterations"][-1]["metrics"]["actor/lr"]
    for role in ("actor", "critic"):
        totals = rank_seconds(run, role)
        assert row[f"{role}/update_time_s"] == pytest.approx(totals.max(), rel=1e-12)
        assert row[f"{role}/update_time_s/min"] == pytest.approx(totals.min(), rel=1e-12)


@fit_test
def test_verl_alone_averages_colocate_async_iterations_by_samples(colocate_async_run) -> None:
    """verl's aggregator on the same iterations: every iteration holds 16 samples, so
    its token means are plain means of the iterations' values, off the step's."""
    run, verl = colocate_async_run, verl_aggregate(colocate_async_run)
    drift = {name: abs(verl[name] - by_tokens(run, name)) for name in TOKEN_MEANS}
    assert max(drift.values()) > ITERATION_DRIFT, drift  # 1e-9 is rlmetrics' tolerance
    totals = rank_seconds(run, "actor")
    assert abs(verl["actor/update_time_s"] - totals.max()) > DRIFT
