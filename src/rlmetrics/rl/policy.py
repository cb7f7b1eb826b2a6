"""The PPO clipped policy loss: asymmetric clip, dual clip, rollout importance weights."""

from __future__ import annotations

import torch
from torch import Tensor

from rlmetrics.rl.aggregate import aggregate, check_agg, objective_update
from rlmetrics.rl.counts import BatchCounts
from rlmetrics.rl.types import LossOutput
from rlmetrics.rl.updates import bool_mask, token_mean

LOG_RATIO_CLAMP = 20.0


def check_clip(clip_low: float, clip_high: float, clip_ratio_c: float | None) -> None:
    """Validate clip ranges: 0 <= clip_low < 1, clip_high >= 0, clip_ratio_c > 1."""
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must lie in [0, 1), got {clip_low!r}")
    if not clip_high >= 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high!r}")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1, got {clip_ratio_c!r}")


def clamped_log_ratio(log_probs: Tensor, old_log_probs: Tensor) -> Tensor:
    """logp - old_logp clamped to ±20: the ratio's exponent, and minus ppo_kl's tokens."""
    return (log_probs - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def ppo_token_losses(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token clipped losses and their clip flags, all (B, T).

    ratio = exp(logp - old_logp) per token (clamped in log space to ±20);
    loss = max(-A·ratio, -A·clip(ratio, 1 - clip_low, 1 + clip_high)), and for A < 0
    with dual clip, min(that, -A·clip_ratio_c).

    Returns:
        (losses, clipped: the clipped term is the larger, lower: dual clip active).
    """
    clip_high = clip_low if clip_high is None else clip_high
    check_clip(clip_low, clip_high, clip_ratio_c)
    ratio = torch.exp(clamped_log_ratio(log_probs, old_log_probs))
    unclipped = -advantages * ratio
    clipped_term = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    losses = torch.maximum(unclipped, clipped_term)
    clipped = clipped_term > unclipped
    if clip_ratio_c is None:
        return losses, clipped, torch.zeros_like(clipped)
    dual = -advantages * clip_ratio_c
    lower = (losses > dual) & (advantages < 0)
    losses = torch.where(advantages < 0, torch.minimum(losses, dual), losses)
    return losses, clipped, lower


def ppo_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    counts: BatchCounts | None = None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    clip_ratio_c: float | None = None,
    agg: str = "token-mean",
    norm_constant: float | None = None,
    rollout_is_weights: Tensor | None = None,
) -> LossOutput:
    """PPO/GRPO clipped surrogate with a token-level importance ratio.

    Args:
        log_probs: current log-probs of the sampled tokens, (B, T), with grad.
        old_log_probs: log-probs under the policy that collected the batch, (B, T).
        advantages: per-token advantages, (B, T).
        mask: valid response tokens, (B, T).
        counts: the mini-batch's ``global_counts`` (required with > 1 rank).
        clip_low, clip_high: the ratio's clip range [1 - clip_low, 1 + clip_high]
            (clip_high None: symmetric).
        clip_ratio_c: dual-clip bound for negative advantages (None: off).
        agg, norm_constant: the aggregation mode (see ``aggregate``).
        rollout_is_weights: per-token importance weights correcting for a rollout
            engine that differs from the trainer (e.g. truncated π_old/π_rollout),
            multiplied into the loss, detached; None for 1.

    Returns:
        loss for backward; updates: actor/pg_loss (the mini-batch objective, mean over
        optimizer steps), and per token over all the step's tokens: actor/pg_clipfrac,
        actor/pg_clipfrac_lower, actor/ppo_kl (mean of old_logp - logp, each token's
        log-ratio clamped to ±20 as in the ratio, as verl does).
    """
    check_agg(agg, norm_constant)
    losses, clipped, lower = ppo_token_losses(
        log_probs,
        old_log_probs,
        advantages,
        clip_low=clip_low,
        clip_high=clip_high,
        clip_ratio_c=clip_ratio_c,
    )
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights.detach()
    mask = bool_mask(mask)
    loss = aggregate(losses, mask, counts, agg, norm_constant)
    updates = [
        objective_update("actor/pg_loss", losses, mask, counts, agg, norm_constant),
        token_mean("actor/pg_clipfrac", clipped.double(), mask),
        token_mean("actor/pg_clipfrac_lower", lower.double(), mask),
        token_mean("actor/ppo_kl", -clamped_log_ratio(log_probs, old_log_probs).detach(), mask),
    ]
    return LossOutput(loss, updates)
