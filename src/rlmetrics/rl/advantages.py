"""Advantage estimators, run on the whole batch before it is split: GRPO and GAE."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rlmetrics.rl.updates import bool_mask

SINGLETON_MODES = ("score", "zero")


def group_index(group_ids: Tensor | Sequence[Any]) -> Tensor:
    """Group labels (a tensor, or any hashables such as prompt uids) as 0..G-1."""
    if isinstance(group_ids, Tensor):
        return torch.unique(group_ids, return_inverse=True)[1]
    codes: dict[Any, int] = {}
    return torch.tensor([codes.setdefault(g, len(codes)) for g in group_ids], dtype=torch.long)


def grpo_advantages(
    scores: Tensor,
    group_ids: Tensor | Sequence[Any],
    mask: Tensor | None = None,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    singleton: str = "score",
) -> Tensor:
    """Group-relative advantages: (score - group mean) / (group std + eps).

    The std is the unbiased (ddof=1) sample std of the group, as in GRPO. With
    ``norm_by_std=False`` the advantage is score - group mean (Dr.GRPO; pair it with
    ``agg="seq-mean-token-sum-norm"``).

    A group of one has no sample std. ``singleton="score"`` (the default, verl's
    behaviour) takes mean 0 and std 1 for it: its advantage is score / (1 + eps) (the
    score itself without std normalisation), so such a prompt still teaches something.
    ``singleton="zero"`` gives it advantage 0 (no baseline, no signal).

    Args:
        scores: one score per sequence, (B,).
        group_ids: the prompt each sequence answers, (B,).
        mask: response mask (B, T): the advantage is broadcast to its valid tokens.

    Returns:
        (B,) advantages, or (B, T) when ``mask`` is given (0 outside the mask).
    """
    if singleton not in SINGLETON_MODES:
        raise ValueError(f"singleton must be one of {SINGLETON_MODES}, got {singleton!r}")
    index = group_index(group_ids).to(scores.device)
    if index.shape != scores.shape[:1] or scores.dim() != 1:
        raise ValueError(
            f"grpo_advantages: scores must be (B,) with one group id each, got scores "
            f"{tuple(scores.shape)} and {index.numel()} group ids"
        )
    num_groups = int(index.max()) + 1 if index.numel() else 0
    zeros = scores.new_zeros(num_groups)
    size = zeros.index_add(0, index, torch.ones_like(scores))
    alone = size == 1
    mean = zeros.index_add(0, index, scores) / size.clamp_min(1)
    if singleton == "score":
        mean = torch.where(alone, zeros, mean)
    deviation = scores - mean[index]
    advantages = deviation
    if norm_by_std:
        var = zeros.index_add(0, index, deviation.square()) / (size - 1).clamp_min(1)
        std = var.sqrt() if singleton == "zero" else torch.where(alone, 1.0, var.sqrt())
        advantages = deviation / (std[index] + eps)
    if mask is None:
        return advantages
    return torch.where(bool_mask(mask), advantages[:, None], advantages.new_zeros(()))


def gae(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over valid tokens (masked tokens are skipped).

    δ_t = r_t + γ·V_next - V_t and A_t = δ_t + γλ·A_next, where "next" is the next
    valid token of the sequence (0 after the last one).

    Returns:
        (advantages, returns = advantages + values), both (B, T), 0 outside ``mask``.
    """
    mask = bool_mask(mask)
    zero = values.new_zeros(())
    next_value = values.new_zeros(values.shape[0])
    next_adv = values.new_zeros(values.shape[0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        valid = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(valid, adv, zero)
        next_adv = torch.where(valid, adv, next_adv)
        next_value = torch.where(valid, values[:, t], next_value)
    returns = torch.where(mask, advantages + values, zero)
    return advantages, returns


def masked_whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over valid tokens (unbiased var); 0 outside.

    With ``shift_mean=False`` the mean is added back (as in verl and TRL): the result
    keeps the mean and has unit variance. Fewer than two valid tokens give 0 (shifted)
    or the mean, where verl raises.
    """
    mask = bool_mask(mask)
    n = mask.sum()
    clean = torch.where(mask, values, values.new_zeros(()))
    mean = clean.sum() / n.clamp_min(1)
    deviation = torch.where(mask, values - mean, values.new_zeros(()))
    var = deviation.square().sum() / (n - 1).clamp_min(1)
    out = deviation * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, values.new_zeros(()))
