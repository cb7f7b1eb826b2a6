"""ExactRayPPOTrainer on Ray: a training step of two mini-batches and two epochs.

The trainer's own ``build_models`` starts two exact policy workers as Ray actors, and
SkyRL's ``_execute_training_step`` runs 4 optimizer steps over two mini-batches of 35
and 13 response tokens. The step's values must be numpy's over every token of the step;
SkyRL's own trainer, which averages the mini-batches' dicts, must show its drift
(computed from SkyRL's workers' dicts of the same step with SkyRL's ``reduce_metrics``,
as its trainer does).
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import reference
import skyrl_runs

from rlmetrics.integrations.skyrl import ExactRayPPOTrainer, check_version

from local_ray import local_ray

TOL = 1e-6
STEP_KEYS = (
    "policy_entropy", "loss_metrics/clip_ratio", "policy_loss",
    "response_length", "response_length_max", "response_length_min",
)  # fmt: skip
LAST_LR = skyrl_runs.LR * 3 / skyrl_runs.WARMUP  # the 4th optimizer step's, of a warmup
MEAN_LR = skyrl_runs.LR * (0 + 1 + 2 + 3) / 4 / skyrl_runs.WARMUP


def _close(a: float, b: float, tol: float = TOL) -> bool:
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol * 1e-3)


@pytest.fixture(scope="module")
def exact_step(model_dir: Path) -> dict[str, float]:
    setup = {"worker_process_setup_hook": "cpu_skyrl.install", "env_vars": {"OMP_NUM_THREADS": "1"}}
    with local_ray(num_cpus=4, num_gpus=2, runtime_env=setup):
        return skyrl_runs.trainer_step(model_dir)


@pytest.fixture(scope="module")
def skyrl_step(two_ranks: dict[int, dict[str, Any]]) -> dict[str, float]:
    """What SkyRL's trainer reports for the same step with its own workers: the plain
    mean of the mini-batches' dicts (its ``_execute_training_step``)."""
    from skyrl.backends.skyrl_train.workers.worker_utils import reduce_metrics

    lists = defaultdict(list)
    for metrics in two_ranks[0]["plain_step"]:
        for key, value in metrics.items():
            lists[key].append(value)
    return reduce_metrics(lists, sum_loss_metrics=False)


@pytest.fixture(scope="module")
def truth(one_rank: dict[str, Any]) -> dict[str, float]:
    batch = skyrl_runs.make_batch(skyrl_runs.STEP_LENGTHS, seed=2)
    return reference.policy_values(batch, one_rank["reference"]["step"], skyrl_runs.EPS_CLIP)


def test_the_step_is_exact_over_its_mini_batches_and_epochs(
    exact_step: dict[str, float], truth: dict[str, float], skyrl_step: dict[str, float]
) -> None:
    for key in STEP_KEYS:
        assert _close(exact_step[key], truth[key]), (key, exact_step[key], truth[key])
    assert exact_step["policy_lr"] == pytest.approx(LAST_LR, rel=1e-12)
    assert _close(exact_step["grad_norm"], skyrl_step["grad_norm"])  # the same 4 steps


def test_skyrls_trainer_averages_the_mini_batches(
    skyrl_step: dict[str, float], truth: dict[str, float]
) -> None:
    for key in ("loss_metrics/clip_ratio", "policy_loss", "response_length"):
        assert not _close(skyrl_step[key], truth[key], tol=1e-3), key
    assert skyrl_step["policy_lr"] == pytest.approx(MEAN_LR, rel=1e-12)


def test_build_models_refuses_workers_it_has_no_exact_version_of() -> None:
    trainer = ExactRayPPOTrainer.__new__(ExactRayPPOTrainer)  # build_models checks first
    with pytest.raises(ValueError, match="policy worker must be SkyRL's FSDP policy worker"):
        trainer.build_models(object, object, object)


def test_another_skyrl_version_is_refused() -> None:
    check_version()  # the installed one
    with pytest.raises(RuntimeError, match=r"tested with SkyRL 0\.4\.0, but SkyRL 0\.5\.0"):
        check_version("0.5.0")
