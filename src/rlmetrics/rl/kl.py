"""KL estimators between the policy and a reference: as a loss and as a reward penalty."""

from __future__ import annotations

import torch
from torch import Tensor

from rlmetrics.rl.aggregate import aggregate, check_agg, objective_update
from rlmetrics.rl.counts import BatchCounts
from rlmetrics.rl.types import LossOutput
from rlmetrics.rl.updates import MetricUpdate, bool_mask, token_mean

BASE_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_ESTIMATORS = BASE_ESTIMATORS + tuple(f"{name}+" for name in BASE_ESTIMATORS)
LOW_VAR_KL_CLAMP = 10.0
LOG_RATIO_CLAMP = 20.0


def check_estimator(estimator: str) -> None:
    """Raise ValueError naming ``estimator`` unless it is one of ``KL_ESTIMATORS``."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def forward_estimate(diff: Tensor, estimator: str) -> Tensor:
    """The value of a base estimator at d = logp - ref_logp."""
    if estimator in ("kl", "k1"):
        return diff
    if estimator == "abs":
        return diff.abs()
    if estimator in ("mse", "k2"):
        return 0.5 * diff.square()
    # k3: the log-ratio is clamped first, so logp = -inf gives the clamp value, not NaN
    neg = (-diff).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(neg) - neg - 1.0).clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


def kl_estimate(log_probs: Tensor, ref_log_probs: Tensor, estimator: str = "low_var_kl") -> Tensor:
    """Per-token estimate of KL(π || π_ref) from log-probs of the sampled tokens.

    With d = logp - ref_logp: kl/k1 = d; abs = |d|; mse/k2 = d²/2; low_var_kl/k3 =
    exp(-d') + d' - 1 with d' = clamp(d, ±20), clamped to [-10, 10] (Schulman's
    estimator). A name ending in ``+`` (``k1+``, ``k3+``, ``low_var_kl+``, ``abs+``, ...)
    is straight-through: its value is the base estimator's, its gradient that of
    k2 = d²/2 (an unbiased gradient of the KL), as verl's ``kl_penalty`` does.
    """
    check_estimator(estimator)
    diff = log_probs - ref_log_probs
    if not estimator.endswith("+"):
        return forward_estimate(diff, estimator)
    value = forward_estimate(diff, estimator[:-1]).detach()
    surrogate = 0.5 * diff.square()
    return surrogate - surrogate.detach() + value


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
        (token rewards, masked to 0 outside ``mask``; updates:
        actor/reward_kl_penalty_coeff (last: the coefficient) and
        actor/reward_kl_penalty (per-token mean of kl over all valid tokens; verl
        reports the mean over rows of each row's token mean, see docs/rl.md)).
    """
    mask = bool_mask(mask)
    kl = kl_estimate(log_probs, ref_log_probs, estimator).detach()
    rewards = torch.where(mask, token_scores - kl_coef * kl, token_scores.new_zeros(()))
    return rewards, [
        MetricUpdate("actor/reward_kl_penalty_coeff", "last", kl_coef),
        token_mean("actor/reward_kl_penalty", kl, mask),
    ]


def kl_coef_update(kl_coef: float | Tensor) -> MetricUpdate:
    """actor/kl_coef: the KL *loss* coefficient in effect this step (kind ``last``)."""
    return MetricUpdate("actor/kl_coef", "last", kl_coef)
