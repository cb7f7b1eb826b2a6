"""KL estimators between the policy and a reference: as a loss and as a reward penalty."""

from __future__ import annotations

import torch
from torch import Tensor

from rlmetrics.rl.aggregate import aggregate, check_agg, objective_update
from rlmetrics.rl.counts import BatchCounts
from rlmetrics.rl.types import LossOutput
from rlmetrics.rl.updates import MetricUpdate, bool_mask, token_mean

KL_ESTIMATORS = ("k1", "abs", "mse", "k2", "low_var_kl", "k3")
LOW_VAR_KL_CLAMP = 10.0


def kl_estimate(log_probs: Tensor, ref_log_probs: Tensor, estimator: str = "low_var_kl") -> Tensor:
    """Per-token estimate of KL(π || π_ref) from log-probs of the sampled tokens.

    With d = logp - ref_logp: k1 = d; abs = |d|; mse (k2) = d²/2;
    low_var_kl (k3) = exp(-d) + d - 1, clamped to [-10, 10] (Schulman's estimator).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    diff = log_probs - ref_log_probs
    if estimator == "k1":
        return diff
    if estimator == "abs":
        return diff.abs()
    if estimator in ("mse", "k2"):
        return 0.5 * diff.square()
    kl = torch.exp(-diff) + diff - 1.0
    return kl.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


def kl_loss(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    mask: Tensor,
    *,
    counts: BatchCounts | None = None,
    estimator: str = "low_var_kl",
    agg: str = "token-mean",
    norm_constant: float | None = None,
) -> LossOutput:
    """KL to the reference policy as a loss (multiply ``loss`` by your kl_coef).

    Returns:
        loss for backward (unweighted by the coefficient); updates: actor/kl_loss (the
        mini-batch objective, mean over optimizer steps).
    """
    check_agg(agg, norm_constant)
    kl = kl_estimate(log_probs, ref_log_probs, estimator)
    mask = bool_mask(mask)
    loss = aggregate(kl, mask, counts, agg, norm_constant)
    return LossOutput(
        loss, [objective_update("actor/kl_loss", kl, mask, counts, agg, norm_constant)]
    )


def kl_penalty_rewards(
    token_scores: Tensor,
    log_probs: Tensor,
    ref_log_probs: Tensor,
    mask: Tensor,
    *,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[Tensor, list[MetricUpdate]]:
    """Token rewards with the KL penalty subtracted: r = score - kl_coef · kl.

    Run it on the whole batch (or any split: it is per token) before advantages.

    Returns:
        (token rewards, masked to 0 outside ``mask``; updates: actor/kl_coef (last)
        and actor/reward_kl_penalty (per token mean of kl)).
    """
    mask = bool_mask(mask)
    kl = kl_estimate(log_probs, ref_log_probs, estimator).detach()
    rewards = torch.where(mask, token_scores - kl_coef * kl, token_scores.new_zeros(()))
    return rewards, [kl_coef_update(kl_coef), token_mean("actor/reward_kl_penalty", kl, mask)]


def kl_coef_update(kl_coef: float | Tensor) -> MetricUpdate:
    """actor/kl_coef: the coefficient in effect this step (kind ``last``)."""
    return MetricUpdate("actor/kl_coef", "last", kl_coef)
