"""Entropy of the policy from logits, and the entropy bonus."""

from __future__ import annotations

import torch
from torch import Tensor

from rlmetrics.rl.aggregate import aggregate, check_agg, objective_update
from rlmetrics.rl.counts import BatchCounts
from rlmetrics.rl.types import LossOutput
from rlmetrics.rl.updates import bool_mask, token_mean


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dimension: logsumexp(z) - Σ p·z."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


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
        loss for backward; updates: actor/entropy (per token, over all the step's
        tokens) and actor/entropy_loss (the mini-batch objective, mean over optimizer
        steps).
    """
    check_agg(agg, norm_constant)
    mask = bool_mask(mask)
    loss = aggregate(entropy, mask, counts, agg, norm_constant)
    updates = [
        token_mean("actor/entropy", entropy.detach(), mask),
        objective_update("actor/entropy_loss", entropy, mask, counts, agg, norm_constant),
    ]
    return LossOutput(loss, updates)
