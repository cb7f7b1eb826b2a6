"""ExactGRPOTrainer on the rest of TRL 1.16's GRPO objective, against real TRL.

A tiny Qwen3-MoE (built from a config, ``router_aux_loss_coef`` at its default, so TRL
adds the load-balancing loss) trains with both trainers at every split of the suite, on
one process and on two. The loss types cispo, sapo, luspo and vespo, the entropy bonus
(fixed and adaptive), the high-entropy token mask, the off-policy sequence mask and
``multi_objective_aggregation="normalize_then_sum"`` train in four runs per trainer
(``grpo_runs.LOSS_VARIANTS``), two of them on two processes.

Everywhere ExactGRPOTrainer trains as GRPOTrainer (same gradient norms, losses and
rewards, run for run), logs the same keys, and logs the value numpy computes over the
whole logging window; plain TRL's values drift where the tests name a drift.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("trl", reason="needs the .venv-trl environment (make test-trl)")

sys.path.insert(0, str(Path(__file__).parent))
import grpo_runs
import reference
from grpo_runs import LOSS_VARIANTS, ONE_PROCESS, TWO_PROCESSES, RunSpec
from reference import TOL, close, logged, mismatches, spread

# the one-process MoE fixture is 12 runs; under a loaded CI machine it outlasts the
# suite's default of 300 s per test
pytestmark = pytest.mark.timeout(900)

MOE = "+qwen3_moe"
# the terms TRL computes per micro-batch: their keys depend on the split by definition
PER_MICRO_BATCH = {"aux_loss", "loss"}


@pytest.fixture(scope="module")
def moe_one_process(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Both trainers on the MoE at every one-process split: key -> [result]."""
    out = tmp_path_factory.mktemp("moe")
    specs = grpo_runs.moe_specs(ONE_PROCESS)
    return {spec.key: [grpo_runs.run(spec, model_dir, str(out))] for spec in specs}


@pytest.fixture(scope="module")
def variants_one_process(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Both trainers on the loss variants run on one process: key -> [result]."""
    out = tmp_path_factory.mktemp("variants")
    specs = grpo_runs.variant_specs(1)
    return {spec.key: [grpo_runs.run(spec, model_dir, str(out))] for spec in specs}


def _moe_runs(group: str, request: pytest.FixtureRequest) -> tuple[dict, list[tuple[int, int]]]:
    if group == "one_process":
        return request.getfixturevalue("moe_one_process"), ONE_PROCESS
    return request.getfixturevalue("two_processes"), TWO_PROCESSES


def _check_against_numpy(result: list[dict]) -> None:
    """Every logged step of a run against numpy over the window, all processes."""
    captures = [rank["captures"] for rank in result]
    for entry in result[0]["logs"]:
        want = reference.expected(captures, entry["step"], result[0]["spec"])
        wrong = mismatches(entry, want)
        assert not wrong, f"{result[0]['spec']}: step {entry['step']}: (logged, numpy) {wrong}"


def _check_trains_as_trl(exact: list[dict], plain: list[dict]) -> None:
    """Same gradient norms, losses and rewards at every step, and the same keys."""
    for mine, theirs in zip(logged(exact), logged(plain), strict=True):
        assert set(mine) == set(theirs), set(mine) ^ set(theirs)
        for key in ("grad_norm", "loss", "reward", "aux_loss"):
            if key in theirs:
                assert close(mine[key], theirs[key]), (key, mine[key], theirs[key])


@pytest.mark.parametrize("group", ["one_process", "two_processes"])
def test_moe_trains_as_trl_and_logs_whole_batch_numpy(
    group: str, request: pytest.FixtureRequest
) -> None:
    """The load-balancing loss is in the loss both trainers train (same gradient norms,
    losses and `aux_loss`) and every key ExactGRPOTrainer logs is numpy's over the
    window: `aux_loss` the mean of the window's micro-batches' load-balancing losses,
    `loss` the policy loss plus 0.001 times that."""
    runs, splits = _moe_runs(group, request)
    for p, a in splits:
        exact, plain = runs["exact" + MOE, f"{p}x{a}"], runs["plain" + MOE, f"{p}x{a}"]
        assert all("aux_loss" in entry for entry in logged(exact))
        _check_trains_as_trl(exact, plain)
        _check_against_numpy(exact)


# the rows of the MoE drift table in docs/trl.md (printed by the test below, pytest -s)
DRIFT_ROWS = [
    (1, "entropy"),
    (2, "clip_ratio/region_mean"),
    (2, "clip_ratio/high_max"),
    (1, "aux_loss"),
    (1, "loss"),
]


@pytest.mark.parametrize("group", ["one_process", "two_processes"])
def test_moe_plain_trl_drifts_and_exact_does_not(
    group: str, request: pytest.FixtureRequest
) -> None:
    """At step 1 (same weights for every split) ExactGRPOTrainer logs every key but the
    per-micro-batch terms equal across splits; plain TRL's entropy and clip ratios
    change with the split. The load-balancing loss is computed per micro-batch, so
    `aux_loss` (and the gradient, hence later steps) depends on the split for both."""
    runs, splits = _moe_runs(group, request)
    print(reference.drift_table(runs, ("plain" + MOE, "exact" + MOE), splits, DRIFT_ROWS))
    exact, plain = spread(runs, "exact" + MOE, splits), spread(runs, "plain" + MOE, splits)
    drifting = {k: v for k, v in exact.items() if k[0] == 1 and v > TOL}
    assert set(key for _, key in drifting) <= PER_MICRO_BATCH | {"grad_norm"}, drifting
    assert exact[1, "aux_loss"] > 1e-4 and close(exact[1, "aux_loss"], plain[1, "aux_loss"])
    assert plain[1, "entropy"] > 1e-5
    assert plain[2, "clip_ratio/high_max"] > 0.05 or plain[2, "kl"] > 1e-4


def test_moe_construction_says_aux_loss_depends_on_the_split(
    model_dir: Path, tmp_path: Path
) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from rlmetrics.integrations.trl import ExactGRPOTrainer

    path = model_dir / grpo_runs.MOE_SUBDIR
    spec = RunSpec("exact", 4, 2, grpo_runs.OPTIONS, model="qwen3_moe")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's own
        warnings.filterwarnings("always", message="ExactGRPOTrainer")
        with pytest.warns(UserWarning, match=r"load-balancing loss.*`aux_loss` and `loss`"):
            ExactGRPOTrainer(
                model=AutoModelForCausalLM.from_pretrained(path),
                reward_funcs=[grpo_runs.reward_vowels],
                args=grpo_runs.make_config(spec, str(tmp_path)),
                train_dataset=Dataset.from_dict({"prompt": grpo_runs.PROMPTS}),
                processing_class=PreTrainedTokenizerFast.from_pretrained(path),
            )


# per variant: keys it must log, and (step, key) where plain TRL's value differs from
# the whole window's (its drift)
VARIANT_KEYS = {
    "cispo": ({"cispo_clip_ratio"}, [(2, "cispo_clip_ratio"), (1, "entropy")]),
    "vespo": (
        {"vespo/phi_seq_mean", "policy_loss", "entropy_coef"},
        [(2, "policy_loss"), (2, "entropy_coef")],
    ),
    "sapo": (set(), [(1, "entropy")]),
    "luspo": ({"policy_loss", "entropy_coef", "clip_ratio/high_max"}, [(2, "kl")]),
}


@pytest.mark.parametrize("name", list(LOSS_VARIANTS))
def test_variant_trains_as_trl_and_logs_whole_batch_numpy(
    name: str, request: pytest.FixtureRequest
) -> None:
    """Each variant: the same training as GRPOTrainer, the same keys, numpy's value for
    every key at every logged step; plain TRL's value of the drifting keys is not."""
    _, processes, (p, a), _ = LOSS_VARIANTS[name]
    runs = request.getfixturevalue("two_processes" if processes == 2 else "variants_one_process")
    exact, plain = runs[f"exact+{name}", f"{p}x{a}"], runs[f"plain+{name}", f"{p}x{a}"]
    keys, drifts = VARIANT_KEYS[name]
    assert all(keys <= set(entry) for entry in logged(exact)), keys
    _check_trains_as_trl(exact, plain)
    _check_against_numpy(exact)
    captures = [rank["captures"] for rank in plain]
    for step, key in drifts:
        theirs = next(entry for entry in plain[0]["logs"] if entry["step"] == step)
        want = reference.expected(captures, step, plain[0]["spec"])
        mine = next(entry for entry in exact[0]["logs"] if entry["step"] == step)[key]
        print(f"| {name} {p}x{a} | `{key}` | {step} | {theirs[key]:.6g} | {mine:.6g} |")
        assert not close(theirs[key], want[key]), (name, step, key, theirs[key], want[key])


def test_variants_cover_every_setting() -> None:
    """The runs above set each of the settings this suite claims."""
    options = [opts for opts, *_ in LOSS_VARIANTS.values()]
    loss_types = {opts["loss_type"] for opts in options}
    assert loss_types == {"cispo", "sapo", "luspo", "vespo"}
    for setting in (
        "top_entropy_quantile",
        "off_policy_mask_threshold",
        "entropy_coef",
        "use_adaptive_entropy",
        "multi_objective_aggregation",
    ):
        assert any(setting in opts for opts in options), setting


def test_normalize_then_sum_zero_spread_flags_match_numpy() -> None:
    """The zero-spread flag of normalize_then_sum (one per generation batch) against
    numpy, on batches with and without spread and with a function that abstains."""
    import torch

    from rlmetrics.integrations.trl_rollout import zero_std_normalized_sum

    flat = np.array([[1.0, 0.5]] * 4 + [[0.0, np.nan]] * 4)  # every group flat
    mixed = np.array([[1.0, 0.5], [0.0, 0.5], [1.0, np.nan], [0.0, 0.1]] + [[0.0, 0.0]] * 4)
    for rewards in (flat, mixed):
        want = reference.zero_std_normalized_sum(rewards, 4)
        got = zero_std_normalized_sum(torch.tensor(rewards), torch.ones(2), 4)
        assert got.tolist() == want.tolist()
    assert reference.zero_std_normalized_sum(flat, 4).all()
    assert not reference.zero_std_normalized_sum(mixed, 4).any()
