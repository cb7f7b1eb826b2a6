"""The whole-batch values, computed with numpy from per-token model outputs of one
forward pass over the whole batch: what a metric means, independent of SkyRL's code."""

from __future__ import annotations

from typing import Any

import numpy as np


def _token_mean(values: np.ndarray, mask: np.ndarray) -> float:
    return float((values * mask).sum() / mask.sum())


def policy_values(batch: dict[str, Any], outputs: dict[str, np.ndarray], eps: float) -> dict:
    """PPO's policy metrics over every response token of ``batch`` (raw advantages)."""
    mask = batch["loss_mask"].double().numpy()
    old = batch["action_log_probs"].double().numpy()
    base = batch["base_action_log_probs"].double().numpy()
    advantages = batch["advantages"].double().numpy()
    log_probs = outputs["log_probs"]
    ratio = np.exp(np.clip(log_probs - old, -20.0, 20.0))
    surr1 = ratio * advantages
    surr2 = np.clip(ratio, 1 - eps, 1 + eps) * advantages
    log_ratio = np.clip(base - log_probs, -20.0, 20.0)
    kl = np.clip(np.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0) * mask  # k3, per token
    lengths = batch["response_mask"].numpy().sum(-1)
    return {
        "policy_entropy": _token_mean(outputs["entropy"], mask),
        "loss_metrics/clip_ratio": _token_mean((-surr2 > -surr1).astype(float), mask),
        "policy_kl": float(np.mean(kl.sum(-1) / np.maximum(mask.sum(-1), 1.0))),
        "policy_loss": _token_mean(-np.minimum(surr1, surr2), mask),
        "response_length": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "response_length_min": float(lengths.min()),
    }


def critic_values(batch: dict[str, Any], values: np.ndarray, clip: float) -> dict:
    """The clipped value loss (a mean over sequences) and its token statistics."""
    mask = batch["loss_mask"].double().numpy()
    old = batch["values"].double().numpy()
    returns = batch["returns"].double().numpy()
    clipped = old + np.clip(values - old, -clip, clip)
    surr1, surr2 = (clipped - returns) ** 2, (values - returns) ** 2
    per_sequence = (np.maximum(surr1, surr2) * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0)
    return {
        "critic_loss": float(0.5 * per_sequence.mean()),
        "values_clipfrac": _token_mean((surr1 > surr2).astype(float), mask),
        "values_mean": _token_mean(values, mask),
    }
