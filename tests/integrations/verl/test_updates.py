"""verl 0.9.1's own actor and critic updates: exact with the integration, drifting without.

One spawned process (1 rank) and one spawned pair (2 gloo ranks) each run every split
of ``scenarios.SPLITS`` with the integration on, then off, through
``ActorRolloutRefWorker(role="actor").update_actor`` and the critic's
``TrainingWorker.train_mini_batch``, and report what verl's driver would log; once on
each of verl's FSDP engines (``scenarios.STRATEGIES``: FSDP2, and FSDP1, verl's default).
"""

from __future__ import annotations

import json
import os

import pytest
from scenarios import (
    ACTOR_METRICS,
    CRITIC_METRICS,
    PEAK_LR,
    SINGLE_STEP_ONLY,
    SPLITS,
    STRATEGIES,
    collect,
)

from gloo_ranks import free_port, ok_results, run_ranks

# the fixtures spawn verl (an import of ~11 s per process, more on a loaded machine)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

TOLERANCE = 1e-6  # fp32 model: splits differ by float32 rounding only
DRIFTING = {  # verl's mean of micro-batch means (this batch moves them by > 1e-3)
    "actor": ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"),
    "critic": ("critic/vf_clipfrac", "critic/vpred_mean"),
}
NAMES = {"actor": ACTOR_METRICS, "critic": CRITIC_METRICS}


def _run(world_size: int, model_path: str) -> list[dict]:
    """Every rank's results; also written as JSON to $RLMETRICS_VERL_RESULTS_DIR when set
    (the numbers docs/verl.md quotes)."""
    # verl's Worker records MASTER_PORT (collect sets it); the group itself is gloo_ranks'
    outcome = run_ranks(
        collect, world_size, free_port(), model_path, timeout=900.0, pg_timeout=600.0
    )
    results = ok_results(outcome)
    folder = os.environ.get("RLMETRICS_VERL_RESULTS_DIR")
    if folder:
        with open(os.path.join(folder, f"ranks{world_size}.json"), "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    return results


@pytest.fixture(scope="module")
def one_rank(model_path: str) -> dict:
    return _run(1, model_path)[0]


@pytest.fixture(scope="module")
def two_ranks(model_path: str) -> list[dict]:
    return _run(2, model_path)


def _truth(one_rank: dict, role: str, strategy: str) -> dict[str, float]:
    """One micro-batch on one rank, as verl itself reports it (the integration off) on
    ``strategy``: the value every split must reproduce."""
    return one_rank[strategy]["verl"][role]["whole"]


def _names(role: str, split: str, names: tuple | None = None) -> tuple:
    """The metrics to compare for a split: one-step metrics only on one-step splits."""
    names = NAMES[role] if names is None else names
    if SPLITS[split].get("mini_batches", 1) == 1:
        return tuple(names)
    return tuple(n for n in names if n not in SINGLE_STEP_ONLY)


def _assert_close(got: dict[str, float], want: dict[str, float], names: tuple, where: str):
    for name in names:
        assert name in got, f"{where}: {name} missing from {sorted(got)}"
        assert got[name] == pytest.approx(want[name], rel=TOLERANCE, abs=TOLERANCE), (
            f"{where}: {name} = {got[name]!r}, whole batch on one rank = {want[name]!r}"
        )


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_one_rank_every_split_equals_the_whole_batch(
    one_rank: dict, role: str, strategy: str
) -> None:
    truth = _truth(one_rank, role, strategy)
    for split in SPLITS:
        got = one_rank[strategy]["exact"][role][split]
        _assert_close(got, truth, _names(role, split), f"{strategy}, 1 rank, {split}")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_two_ranks_every_split_equals_the_whole_batch(
    one_rank: dict, two_ranks: list[dict], role: str, strategy: str
) -> None:
    truth = _truth(one_rank, role, strategy)
    for rank, result in enumerate(two_ranks):
        for split in SPLITS:
            got = result[strategy]["exact"][role][split]
            where = f"{strategy}, 2 ranks, rank {rank}, {split}"
            _assert_close(got, truth, _names(role, split), where)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_fsdp1_and_fsdp2_compute_the_same_whole_batch(one_rank: dict, role: str) -> None:
    """The same model, batch and fp32 settings on either engine: the same forward pass,
    so one truth for both (float32 rounding apart)."""
    truth = _truth(one_rank, role, "fsdp2")
    _assert_close(_truth(one_rank, role, "fsdp"), truth, NAMES[role], "fsdp, 1 rank, whole")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_without_the_integration_verl_drifts(
    one_rank: dict, two_ranks: list[dict], role: str, strategy: str
) -> None:
    """The same runs, integration off: verl's ratios move with the split (so the tests
    above can fail); within one mini-batch its losses and grad norms do not (so the
    integration must leave them equal too); over two mini-batches verl averages the
    mini-batches' losses unweighted, and they move too."""
    truth = _truth(one_rank, role, strategy)
    runs = [("1 rank", one_rank)] + [(f"2 ranks, rank {r}", x) for r, x in enumerate(two_ranks)]
    one_step = [s for s in SPLITS if SPLITS[s].get("mini_batches", 1) == 1]
    stable = tuple(n for n in NAMES[role] if n not in DRIFTING[role])
    for where, result in runs:
        for split in one_step:
            got = result[strategy]["verl"][role][split]
            _assert_close(got, truth, stable, f"verl, {strategy}, {where}, {split}")
    drift = {
        name: max(
            abs(x[strategy]["verl"][role][s][name] - truth[name]) for _, x in runs for s in SPLITS
        )
        for name in DRIFTING[role]
    }
    assert all(d > 1e-3 for d in drift.values()), f"verl's drift on this batch: {drift}"
    loss = f"{role}/pg_loss" if role == "actor" else "critic/vf_loss"
    moved = abs(one_rank[strategy]["verl"][role]["2minibatches"][loss] - truth[loss])
    assert moved > 1e-5, f"verl's {loss} over two mini-batches moved by {moved}"


def test_lr_is_the_lr_the_step_used(one_rank: dict) -> None:
    """Warmup of 4 steps: the first update steps with lr 0, the second with PEAK_LR/4.
    verl logs the scheduler's value after stepping (the next step's)."""
    assert one_rank["lr_exact"] == pytest.approx([0.0, PEAK_LR / 4])
    assert one_rank["lr_verl"] == pytest.approx([PEAK_LR / 4, PEAK_LR / 2])


def test_the_plugin_is_on_after_import_verl(one_rank: dict, two_ranks: list[dict]) -> None:
    """Installed rlmetrics registers the ``verl.plugins`` entry point: a fresh process
    that only imports verl has the integration loaded."""
    assert one_rank["plugin_loaded_by_import_verl"]
    assert all(r["plugin_loaded_by_import_verl"] for r in two_ranks)
