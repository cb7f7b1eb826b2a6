"""The critic's clipped value loss."""

from __future__ import annotations

import torch
from torch import Tensor

from rlmetrics.rl.aggregate import aggregate, check_agg, objective_update
from rlmetrics.rl.counts import BatchCounts
from rlmetrics.rl.types import LossOutput
from rlmetrics.rl.updates import bool_mask, token_mean


def value_token_losses(
    values: Tensor, old_values: Tensor, returns: Tensor, cliprange_value: float | None
) -> tuple[Tensor, Tensor]:
    """Per-token 0.5·max((v - R)², (clip(v, v_old ± c) - R)²) and the clip flags.

    A token counts as clipped only when |v - v_old| > c and the clipped term wins: a
    token whose value moved less than c has clip(v) = v exactly (never rebuilt as
    v_old + (v - v_old), whose rounding would decide the flag).
    """
    unclipped = (values - returns).square()
    if cliprange_value is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    if not cliprange_value >= 0:
        raise ValueError(f"cliprange_value must be >= 0, got {cliprange_value!r}")
    moved = values - old_values
    outside = moved.abs() > cliprange_value
    clipped_values = torch.where(
        outside, old_values + moved.clamp(-cliprange_value, cliprange_value), values
    )
    clipped = (clipped_values - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), outside & (clipped > unclipped)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    counts: BatchCounts | None = None,
    cliprange_value: float | None = 0.5,
    agg: str = "token-mean",
    norm_constant: float | None = None,
) -> LossOutput:
    """Clipped value loss (PPO critic).

    Args:
        values: current value predictions, (B, T), with grad.
        old_values: predictions when the batch was collected, (B, T).
        returns: targets, (B, T).
        cliprange_value: clip of the new prediction around the old (None: off).

    Returns:
        loss for backward; updates: critic/vf_loss (the mini-batch objective, mean
        over optimizer steps), and per token: critic/vf_clipfrac, critic/vpred_mean.
    """
    check_agg(agg, norm_constant)
    mask = bool_mask(mask)
    losses, clipped = value_token_losses(values, old_values, returns, cliprange_value)
    loss = aggregate(losses, mask, counts, agg, norm_constant)
    updates = [
        objective_update("critic/vf_loss", losses, mask, counts, agg, norm_constant),
        token_mean("critic/vf_clipfrac", clipped.double(), mask),
        token_mean("critic/vpred_mean", values.detach(), mask),
    ]
    return LossOutput(loss, updates)
