"""The integration's opt-in extras (``RLMETRICS_VERL_DETAIL``) on verl 0.9.1's own updates.

Two spawned gloo ranks run verl's actor ``update_actor`` and critic ``train_mini_batch``
on one 8-sequence batch whose sources place no ``"b"`` row on rank 1 (``detail_scenarios``),
for several splits, with the switch off, on, and off again. Every per-source number is
checked against numpy over the whole batch, from the ranks' own forward passes.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from detail_scenarios import (
    DETAIL_SPLITS,
    FIRST_UPDATE_RUNS,
    LATE_UPDATES,
    SLOW_RANK,
    SLOW_SECONDS,
    collect_detail,
    collect_first_updates,
    whole_batch,
)
from scenarios import ACTOR_METRICS, CRITIC_METRICS, trainer_config

from verl_formulas import kl_penalty, update_metrics

from gloo_ranks import free_port, ok_results, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

TOLERANCE = 1e-6
WORLD_SIZE = 2
# the update metrics a source has a value of: all but the optimizer step's
OPTIMIZER_STEP = ("actor/grad_norm", "actor/lr", "critic/grad_norm")
PER_SOURCE = {
    "actor": tuple(m for m in ACTOR_METRICS if m not in OPTIMIZER_STEP),
    "critic": tuple(m for m in CRITIC_METRICS if m not in OPTIMIZER_STEP),
}
SOURCE_NAMES = ("a", "b")


@pytest.fixture(scope="module")
def ranks(model_path: str) -> list[dict]:
    """Every rank's results; also written as JSON to $RLMETRICS_VERL_RESULTS_DIR when set."""
    outcome = run_ranks(
        collect_detail, WORLD_SIZE, free_port(), model_path, timeout=900.0, pg_timeout=600.0
    )
    results = ok_results(outcome)
    folder = os.environ.get("RLMETRICS_VERL_RESULTS_DIR")
    if folder:
        with open(os.path.join(folder, "detail.json"), "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    return results


@pytest.fixture(scope="module")
def truth(ranks: list[dict], model_path: str) -> dict[str, float]:
    """Every per-source metric in numpy, over the whole batch's rows of that source."""
    b = whole_batch(ranks)
    config = trainer_config(os.path.join(model_path, "actor"))
    actor = config.actor_rollout_ref.actor
    out: dict[str, float] = {}
    for source in SOURCE_NAMES:
        mask = b["mask"] & (b["sources"] == source)[:, None]
        values = update_metrics(
            old=b["old_log_probs"],
            logp=b["new_log_probs"],
            adv=b["advantages"],
            entropy=b["new_entropy"],
            ref=b["ref_log_prob"],
            vpreds=b["new_values"],
            values=b["values"],
            returns=b["returns"],
            m=mask,
            low=actor.clip_ratio_low,
            high=actor.clip_ratio_high,
            c=actor.clip_ratio_c,
            kl_name=actor.kl_loss_type,
            clip=config.critic.cliprange_value,
        )
        out |= {f"{name}/{source}": value for name, value in values.items()}
    return out


@pytest.mark.parametrize("split", list(DETAIL_SPLITS))
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_every_metric_per_source_equals_numpy_over_the_whole_batch(
    ranks: list[dict], truth: dict, role: str, split: str
) -> None:
    for rank, result in enumerate(ranks):
        logged = result["on"][role][split]
        for name in PER_SOURCE[role]:
            for source in SOURCE_NAMES:
                key = f"{name}/{source}"
                assert key in logged, f"rank {rank}, {split}: {key} missing"
                want = truth[key]
                assert logged[key] == pytest.approx(want, rel=TOLERANCE, abs=TOLERANCE), (
                    f"rank {rank}, {split}: {key} = {logged[key]!r}, numpy {want!r}"
                )


@pytest.mark.parametrize("split", list(DETAIL_SPLITS))
def test_keys_agree_on_every_rank_though_one_holds_no_b(ranks: list[dict], split: str) -> None:
    for role in ("actor", "critic"):
        keys = [r["on"]["keys"][f"{role}/{split}"] for r in ranks]
        assert keys[0] == keys[1], f"{role}, {split}: {set(keys[0]) ^ set(keys[1])}"
        assert any(k.endswith("/b") for k in keys[1]), keys[1]


def test_the_switch_adds_no_collective(ranks: list[dict]) -> None:
    """Per update, in a process that ran updates without the switch first: the same
    number of torch.distributed collectives with the switch on, after one update (the
    first with the per-source names, new to that process, agrees them once; in a job
    the first update is the group's first sync, which agrees anyway: see
    ``test_from_the_first_update_a_late_source_costs_no_collective``)."""
    for rank, result in enumerate(ranks):
        assert result["on"]["collectives"] == result["off"]["collectives"], rank
        assert all(n > 0 for n in result["off"]["collectives"].values())


def test_with_the_switch_off_the_logged_keys_and_values_are_todays(ranks: list[dict]) -> None:
    """Off before and after the switch was on: the same keys and values, none per source
    (the memory and timing figures verl logs aside, which move by themselves)."""
    for result in ranks:
        for role in ("actor", "critic"):
            for split in DETAIL_SPLITS:
                before = result["off"][role][split]
                after = result["off_again"][role][split]
                assert sorted(before) == sorted(after)
                assert not [k for k in before if k.endswith(("/a", "/b", "/p50", "_rank"))]
                stable = {k: v for k, v in before.items() if not k.startswith(VOLATILE)}
                assert stable == {k: after[k] for k in stable}, (role, split)


VOLATILE = ("actor/perf/", "critic/perf/", "perf/", "actor/mfu", "critic/mfu")
"""Keys verl fills with this moment's memory or speed (they differ between two runs)."""


def test_with_the_switch_on_the_other_values_are_unchanged(ranks: list[dict]) -> None:
    for result in ranks:
        for role in ("actor", "critic"):
            for split in DETAIL_SPLITS:
                off, on = result["off"][role][split], result["on"][role][split]
                for key, value in off.items():
                    if not key.startswith(VOLATILE):
                        assert on[key] == value, (role, split, key)


def test_the_sources_are_split_unevenly(ranks: list[dict]) -> None:
    assert np.asarray(ranks[0]["forward"]["log_probs"]).shape[0] == 4


QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}


@pytest.fixture(scope="module")
def token_values(ranks: list[dict], model_path: str) -> dict[str, np.ndarray]:
    """Every response token's entropy, importance ratio and KL over the whole batch."""
    b = whole_batch(ranks)
    actor = trainer_config(os.path.join(model_path, "actor")).actor_rollout_ref.actor
    mask = b["mask"]
    log_ratio = np.clip(b["new_log_probs"] - b["old_log_probs"], -20.0, 20.0)
    kl = kl_penalty(b["new_log_probs"], b["ref_log_prob"], actor.kl_loss_type)
    return {
        "actor/token_entropy": b["new_entropy"][mask],
        "actor/importance_ratio": np.exp(log_ratio)[mask],
        "actor/token_kl": kl[mask],
    }


@pytest.mark.parametrize("split", list(DETAIL_SPLITS))
def test_token_quantiles_are_within_the_sketchs_bound(
    ranks: list[dict], token_values: dict, split: str
) -> None:
    """p50, p90, p99 within the sketch's stated relative error of numpy's element of that
    rank (``method="lower"``); max exact (to float32 rounding of the forward pass)."""
    from rlmetrics.kinds.quantile import QuantileSketch

    bound = QuantileSketch().relative_error
    for rank, result in enumerate(ranks):
        logged = result["on"]["actor"][split]
        for name, values in token_values.items():
            assert logged[f"{name}/max"] == pytest.approx(values.max(), rel=TOLERANCE)
            for key, q in QUANTILES.items():
                want = np.quantile(values, q, method="lower")
                got = logged[f"{name}/{key}"]
                assert abs(got - want) <= bound * abs(want) + TOLERANCE, (
                    f"rank {rank}, {split}: {name}/{key} = {got}, numpy {want}, bound {bound}"
                )


TRAIN_STEPS = {"whole": 1, "micro1": 1, "dynamic16": 1, "2minibatches": 2}
"""Engine train steps (mini-batches) per update, per split."""


@pytest.mark.parametrize("split", list(DETAIL_SPLITS))
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_update_time_is_the_slowest_ranks_and_names_it(
    ranks: list[dict], role: str, split: str
) -> None:
    """Rank 1's engine step is SLOW_SECONDS slower per mini-batch: it is named, its
    time (with the sleeps) is the logged one, every rank logs the same numbers."""
    name = f"{role}/update_time_s"
    logged = [r["on"][role][split] for r in ranks]
    keys = (name, f"{name}/mean", f"{name}/min", f"{name}/slowest_rank")
    assert [{k: x[k] for k in keys} for x in logged] == [{k: logged[0][k] for k in keys}] * 2
    got = logged[0]
    steps = TRAIN_STEPS[split]
    assert got[f"{name}/slowest_rank"] == SLOW_RANK
    assert got[name] >= steps * SLOW_SECONDS
    assert got[name] - got[f"{name}/min"] >= 0.5 * steps * SLOW_SECONDS
    assert got[f"{name}/mean"] == pytest.approx((got[name] + got[f"{name}/min"]) / 2)


@pytest.mark.parametrize("split", list(DETAIL_SPLITS))
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_mfu_is_the_global_tokens_over_the_slowest_time(
    ranks: list[dict], role: str, split: str
) -> None:
    """``perf/mfu/<role>`` (verl's driver renames the worker's ``mfu``): verl's FLOPs for
    the whole batch over the slowest rank's time, per device; with the switch off verl
    averages per-rank ratios over each rank's own time, which the fast rank inflates: on
    the same two ranks' times (2 ranks: the logged max and min) that mean is higher."""
    for result in ranks:
        on = result["on"][role][split][f"{role}/mfu"]
        want = result["on"]["expected_mfu"][f"{role}/{split}"]
        assert on == pytest.approx(want, rel=1e-12)
        assert on > 0
        assert result["on"]["mean_of_rank_ratios"][f"{role}/{split}"] > on * 1.02


@pytest.fixture(scope="module")
def first_updates(model_path: str) -> dict[str, list[dict]]:
    """``collect_first_updates`` in each of ``FIRST_UPDATE_RUNS``, each on fresh ranks."""
    return {
        run: ok_results(
            run_ranks(
                collect_first_updates,
                WORLD_SIZE,
                free_port(),
                model_path,
                run,
                timeout=600.0,
                pg_timeout=300.0,
            )
        )
        for run in FIRST_UPDATE_RUNS
    }


def test_from_the_first_update_a_late_source_costs_no_collective(
    first_updates: dict[str, list[dict]],
) -> None:
    """Fresh processes, as in a job: updates whose first holds no "b" anywhere, the
    second no "a", the third no "b", the last both. With RLMETRICS_VERL_DETAIL=1 and
    RLMETRICS_VERL_SOURCES=a,b every update, the first included, takes the same
    collectives as with the switch off: every rank names both sources' metrics at every
    update (without that, the second update would agree the new names: 3 more)."""
    for rank in range(WORLD_SIZE):
        off, on = first_updates["off"][rank], first_updates["on"][rank]
        for role in ("actor", "critic"):
            assert on[role] == off[role], (rank, role, on[role], off[role])
            assert len(on[role]) == len(LATE_UPDATES)
        assert not any(off["keys"])
        actor_keys = [{key.rsplit("/", 1)[1] for key in keys} for keys in on["keys"][0::2]]
        assert actor_keys == [{"a"}, {"b"}, {"a"}, {"a", "b"}]


def test_without_the_sources_named_a_source_costs_one_agreement_once(
    first_updates: dict[str, list[dict]],
) -> None:
    """Without RLMETRICS_VERL_SOURCES: the update where "b" first appears agrees the
    new names (3 more collectives); no later one does, though the third update holds
    no "b" and the second no "a" (a source reported once stays named)."""
    for rank in range(WORLD_SIZE):
        off, on = first_updates["off"][rank], first_updates["on, sources not named"][rank]
        for role in ("actor", "critic"):
            extra = [a - b for a, b in zip(on[role], off[role], strict=True)]
            assert extra == [0, 3, 0, 0], (rank, role, on[role], off[role])
