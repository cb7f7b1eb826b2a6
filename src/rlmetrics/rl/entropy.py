"""Entropy of the policy from logits, the entropy bonus, and verl's ``actor/entropy``."""

from __future__ import annotations

import torch
from torch import Tensor

from rlmetrics.rl.aggregate import aggregate, check_agg, objective_update, seq_values
from rlmetrics.rl.counts import BatchCounts
from rlmetrics.rl.types import LossOutput
from rlmetrics.rl.updates import MetricUpdate, bool_mask, masked, token_mean


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dimension: logsumexp(z) - Σ p·z."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def entropy_metric(
    entropy: Tensor,
    mask: Tensor,
    agg: str = "token-mean",
    norm_constant: float | None = None,
    name: str = "actor/entropy",
) -> MetricUpdate:
    """The entropy of one pass over the batch, aggregated like the loss (verl's meaning).

    Log it once per sequence per step (verl computes it in the pass that recomputes the
    old log-probs, before any update): token-mean gives the mean over valid tokens;
    the seq-mean modes the mean over sequences with a valid token of each sequence's
    value (token sum, token mean, or token sum / C); token-sum the sum over all valid
    tokens (kind ``sum``). Each merges exactly over any split of the batch.
    """
    check_agg(agg, norm_constant)
    mask = bool_mask(mask)
    entropy = entropy.detach()
    if agg == "token-mean":
        return token_mean(name, entropy, mask)
    if agg == "token-sum":
        return MetricUpdate(name, "sum", masked(entropy, mask).double().sum())
    values = seq_values(entropy, mask, agg, norm_constant)
    return MetricUpdate(name, "mean", values, mask.any(-1))


def entropy_loss(
    entropy: Tensor,
    mask: Tensor,
    *,
    counts: BatchCounts | None = None,
    agg: str = "token-mean",
    norm_constant: float | None = None,
) -> LossOutput:
    """The aggregated entropy (subtract ``coef * loss`` from the total loss).

    Args:
        entropy: per-token entropy, (B, T) (``entropy_from_logits``), with grad.

    Returns:
        loss for backward; updates: actor/entropy_loss (the mini-batch objective, mean
        over optimizer steps) and actor/entropy_token_mean (per token, over all the
        step's update tokens, whatever ``agg``). verl's ``actor/entropy`` is
        ``entropy_metric`` over the batch before the update.
    """
    check_agg(agg, norm_constant)
    mask = bool_mask(mask)
    loss = aggregate(entropy, mask, counts, agg, norm_constant)
    updates = [
        token_mean("actor/entropy_token_mean", entropy.detach(), mask),
        objective_update("actor/entropy_loss", entropy, mask, counts, agg, norm_constant),
    ]
    return LossOutput(loss, updates)
