"""The exact FSDP workers against SkyRL's own, on the real SkyRL 0.4.0 (CPU, gloo).

The same batch (8 sequences, 35 response tokens of uneven length) and weights, split as
in issue 46's table: 1 rank with 1 micro-batch, 2 ranks with micro-batches of 1, 2 and 4
sequences, and 2 ranks with a 16-token budget (where SkyRL gives rank 1 a padding
micro-batch). SkyRL's workers must show their drift; the exact ones must log, on every
split, what numpy computes over the whole batch from one forward pass's per-token
values, and train exactly as SkyRL's do (same losses, same gradient norms).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import reference
import skyrl_runs
import torch

TOL = 1e-6
TRUTH = skyrl_runs.SPLITS[1][0].name
SPLITS = [split.name for splits in skyrl_runs.SPLITS.values() for split in splits]
TWO_RANK_SPLITS = [split.name for split in skyrl_runs.SPLITS[2]]
BUDGET = "2 ranks, 16-token budget"

POLICY_KEYS = (
    "loss_metrics/clip_ratio", "policy_entropy", "policy_kl",
    "response_length", "response_length_max", "response_length_min",
)  # fmt: skip
CRITIC_KEYS = ("critic_loss", "values_mean", "values_clipfrac")

PLAIN_DRIFT = {
    "loss_metrics/clip_ratio": TWO_RANK_SPLITS,
    "policy_entropy": [BUDGET],
    "policy_kl": [BUDGET],
    "response_length": SPLITS,
    "critic_loss": [BUDGET],
    "values_mean": TWO_RANK_SPLITS,
    "values_clipfrac": TWO_RANK_SPLITS,
}
"""Where SkyRL's own value is off the whole batch's by more than 1e-4 (relative)."""


def _close(a: float, b: float, tol: float = TOL) -> bool:
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol * 1e-3)


@pytest.fixture(scope="module")
def truth(one_rank: dict[str, Any]) -> dict[str, float]:
    """numpy's whole-batch values (the split batch, its advantages unscaled)."""
    batch = skyrl_runs.make_batch()
    outputs = one_rank["reference"]["split"]
    return {
        **reference.policy_values(batch, outputs, skyrl_runs.EPS_CLIP),
        **reference.critic_values(batch, outputs["values"], clip=0.2),
    }


def _role(key: str) -> str:
    return "critic" if key in CRITIC_KEYS else "policy"


@pytest.mark.parametrize("split", SPLITS)
def test_exact_workers_log_the_whole_batch_value(
    splits: dict, truth: dict[str, float], split: str
) -> None:
    for key in POLICY_KEYS + CRITIC_KEYS:
        value = splits[split, _role(key), "exact"][key]
        assert _close(value, truth[key]), (split, key, value, truth[key])


def test_skyrl_workers_drift(splits: dict, truth: dict[str, float]) -> None:
    """SkyRL's own values: means of means, the padded width as response_length."""
    for key, drifting in PLAIN_DRIFT.items():
        for split in SPLITS:
            value = splits[split, _role(key), "plain"][key]
            off = not _close(value, truth[key], tol=1e-4)
            assert off == (split in drifting), (split, key, value, truth[key])
    for split in SPLITS:
        assert splits[split, "policy", "plain"]["response_length"] == skyrl_runs.RESPONSE


@pytest.mark.parametrize("split", SPLITS)
def test_losses_and_gradient_norms_are_skyrls(
    splits: dict, truth: dict[str, float], split: str
) -> None:
    """Same loss and gradients: the exact workers only log differently."""
    for role, keys in (
        ("policy", ("policy_loss", "final_loss", "grad_norm")),
        ("critic", ("grad_norm",)),
    ):
        plain, exact = splits[split, role, "plain"], splits[split, role, "exact"]
        for key in keys:
            assert _close(exact[key], plain[key]), (split, role, key)
    assert _close(splits[split, "policy", "exact"]["policy_loss"], truth["policy_loss"])


@pytest.mark.parametrize("split", TWO_RANK_SPLITS)
def test_a_step_of_one_mini_batch_merges_to_the_mini_batch(
    two_ranks: dict[int, dict[str, Any]], split: str
) -> None:
    """The step state both ranks keep, merged as ExactRayPPOTrainer merges it, gives the
    mini-batch's values, the optimizer step's learning rate and gradient norm."""
    from rlmetrics.integrations.skyrl import exact_step_metrics

    for role in ("policy", "critic"):
        states = [two_ranks[rank]["states"][split, role] for rank in (0, 1)]
        mini_batch = two_ranks[0]["splits"][split, role, "exact"]
        step = exact_step_metrics({}, states, replicas=[False, False])
        for key, value in step.items():
            assert _close(value, mini_batch[key]), (role, key, value, mini_batch[key])
        assert {f"{role}_lr", "grad_norm"} <= step.keys()


def test_the_batch_is_split_as_the_table_says(two_ranks: dict[int, dict[str, Any]]) -> None:
    """The 16-token budget gives rank 1 one padding micro-batch (SkyRL's count)."""
    metrics = two_ranks[0]["splits"][BUDGET, "policy", "plain"]
    assert metrics["num_microbatches"] == 3.0
    assert metrics["num_padding_microbatches"] == 0.5  # SkyRL's mean over ranks: 0 and 1
    assert int(skyrl_runs.make_batch()["loss_mask"].sum()) == 35
    assert torch.equal(skyrl_runs.make_batch()["sequences"], skyrl_runs.make_batch()["sequences"])


DOCS = Path(__file__).parents[3] / "docs" / "skyrl.md"
TABLE_KEYS = (
    "loss_metrics/clip_ratio", "policy_entropy", "policy_kl", "response_length",
    "values_mean", "critic_loss", "policy_loss",
)  # fmt: skip


def drift_table(splits: dict) -> str:
    """SkyRL's own values per split, as docs/skyrl.md shows them."""
    header = "| split | " + " | ".join(f"`{key.split('/')[-1]}`" for key in TABLE_KEYS) + " |"
    lines = [header, "|---" * (len(TABLE_KEYS) + 1) + "|"]
    for split in SPLITS:
        values = [splits[split, _role(key), "plain"][key] for key in TABLE_KEYS]
        lines.append(f"| {split} | " + " | ".join(f"{value:.6f}" for value in values) + " |")
    return "\n".join(lines)


def test_the_docs_show_the_measured_drift(splits: dict) -> None:
    """docs/skyrl.md's table is this run's (to its 6 decimals)."""
    measured = drift_table(splits)
    shown = [line for line in DOCS.read_text().splitlines() if line.startswith("| ")]
    rows = [line for line in shown if line.split("|")[1].strip() in SPLITS]
    expected = measured.splitlines()[2:]
    assert len(rows) == len(expected), f"docs/skyrl.md should show:\n{measured}"
    for row, line in zip(rows, expected, strict=True):
        for doc, now in zip(row.split("|")[2:-1], line.split("|")[2:-1], strict=True):
            assert abs(float(doc) - float(now)) <= 2e-6, f"docs/skyrl.md should show:\n{measured}"
