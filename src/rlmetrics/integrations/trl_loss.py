"""The GRPO loss as TRL 1.16 defines it, with metric updates that carry their true weights.

Pure tensor code (no TRL import): ``rlmetrics.integrations.trl`` calls it once per
micro-batch. Nothing here syncs with the device or across ranks; the tracker receives
per-token (or per-sequence) tensors and their weights, and ``Tracker.compute()`` merges
them once per logged step. What each logged key means, independent of how the batch was
split into processes, micro-batches and accumulation steps:

- ``entropy``, ``kl``, ``clip_ratio/{low,high,region}_mean``: token-weighted means over
  every completion token of the logging window (per sequence when
  ``importance_sampling_level="sequence"``, whose ratio is one per sequence).
- ``clip_ratio/low_min``: the smallest, over the window's sequences, per-sequence
  fraction of low-clipped tokens; ``clip_ratio/high_max``: the largest per-sequence
  fraction of high-clipped tokens.
- ``loss``: what the loss type averages, over the whole window: per-sequence token means
  averaged over sequences (``grpo``), per-sequence token sums over
  ``max_completion_length`` averaged over sequences (``dr_grpo``), a token mean
  (``dapo``). ``bnpo`` averages token means of micro-batches, so its loss (and its
  gradient) depends on the micro-batch size; it is logged as such, with a warning.

Given ``by`` (one label per sequence), ``entropy``, ``kl`` and the clip ratios are also
logged per label as ``<key>/<label>``: the same meaning over that label's sequences.

``log_token_quantiles`` logs the window's per-token entropy, importance ratio (one per
sequence with sequence-level sampling) and KL into quantile sketches (fixed-size states
in the same packed sync); ``finish_token_quantiles`` names their results
``<name>/{p50,p90,p99,max}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rlmetrics.tracker import LogMethods

# the loss types whose loss this module computes (and TRL 1.16 computes the same way)
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The trainer settings the loss reads (TRL's names).

    Attributes:
        loss_type: one of ``LOSS_TYPES``.
        beta: KL coefficient; 0 leaves the KL term (and the ``kl`` metric) out.
        epsilon_low: lower clip range of the ratio (``1 - epsilon_low``).
        epsilon_high: upper clip range of the ratio (``1 + epsilon_high``).
        delta: optional upper cap of the unclipped ratio (two-sided clipping).
        importance_sampling_level: "token" or "sequence".
        use_bias_correction_kl: multiply the per-token KL by the ratio.
        max_completion_length: ``dr_grpo``'s constant normaliser.
    """

    loss_type: str
    beta: float
    epsilon_low: float
    epsilon_high: float
    delta: float | None
    importance_sampling_level: str
    use_bias_correction_kl: bool
    max_completion_length: int

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(
                f"ExactGRPOTrainer supports loss_type in {LOSS_TYPES}, got {self.loss_type!r}"
            )
        if self.importance_sampling_level not in ("token", "sequence"):
            raise ValueError(
                "importance_sampling_level must be 'token' or 'sequence', got "
                f"{self.importance_sampling_level!r}"
            )


@dataclass(frozen=True, kw_only=True)
class Normalizer:
    """How this micro-batch's loss is scaled for backward (never what is logged).

    Attributes:
        accumulation_steps: micro-batches per optimizer step (1 in evaluation).
        dapo_tokens: ``dapo``'s divisor, the tokens one optimizer step's share of the
            generation batch holds on this process (unused by other loss types).
    """

    accumulation_steps: float
    dapo_tokens: Tensor | float = 1.0


def importance_ratio(
    per_token_logps: Tensor, old_per_token_logps: Tensor, mask: Tensor, level: str
) -> Tensor:
    """The importance ratio: (B, T) per token, or (B, 1) per sequence (the exp of the
    token-mean log ratio)."""
    log_ratio = per_token_logps - old_per_token_logps
    if level == "sequence":
        tokens = mask.sum(-1).clamp(min=1.0)
        log_ratio = ((log_ratio * mask).sum(-1) / tokens).unsqueeze(-1)
    return torch.exp(log_ratio)


def kl_k3(ref_per_token_logps: Tensor, per_token_logps: Tensor) -> Tensor:
    """The k3 estimator of KL(policy || reference) per token: exp(d) - d - 1, d = ref - logp."""
    diff = ref_per_token_logps - per_token_logps
    return torch.exp(diff) - diff - 1


def per_token_policy_loss(
    ratio: Tensor, advantages: Tensor, config: LossConfig, per_token_kl: Tensor | None
) -> Tensor:
    """The clipped surrogate (negated, to minimise), plus ``beta`` times the KL."""
    clipped = torch.clamp(ratio, 1 - config.epsilon_low, 1 + config.epsilon_high)
    if config.delta is not None:
        ratio = torch.clamp(ratio, max=config.delta)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    if per_token_kl is not None:
        loss = loss + config.beta * per_token_kl
    return loss


def aggregate_loss(
    per_token_loss: Tensor, mask: Tensor, config: LossConfig, scale: Normalizer, log: LogMethods
) -> Tensor:
    """The micro-batch's loss for backward; logs ``loss`` with its meaning's weights."""
    masked = per_token_loss * mask
    loss_type = config.loss_type
    if loss_type == "grpo":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
        log.mean("loss", per_seq.detach())
        return per_seq.mean() / scale.accumulation_steps
    if loss_type == "dr_grpo":
        per_seq = masked.sum(-1) / config.max_completion_length
        log.mean("loss", per_seq.detach())
        return per_seq.mean() / scale.accumulation_steps
    if loss_type == "bnpo":
        micro = masked.sum() / mask.sum().clamp(min=1.0)
        log.mean("loss", micro.detach())  # one value per micro-batch: split-dependent
        return micro / scale.accumulation_steps
    log.mean("loss", _zero_masked(per_token_loss.detach(), mask), weight=mask)  # dapo
    return masked.sum() / scale.dapo_tokens


def log_policy_metrics(
    log: LogMethods,
    *,
    mask: Tensor,
    entropies: Tensor,
    ratio: Tensor,
    advantages: Tensor,
    per_token_kl: Tensor | None,
    config: LossConfig,
    by: Sequence[str] | None = None,
) -> None:
    """Log entropy, KL and the clip ratios of one micro-batch (device tensors, no sync);
    with ``by`` (one label per sequence), each also per label."""
    entropies = _zero_masked(entropies.detach(), mask)
    kl = None if per_token_kl is None else _zero_masked(per_token_kl.detach(), mask)
    ratio = ratio.detach()
    low = (ratio < 1 - config.epsilon_low) & (advantages < 0)
    high = (ratio > 1 + config.epsilon_high) & (advantages > 0)
    if ratio.shape[-1] == 1:  # one ratio per sequence: each sequence weighs 1
        low, high = low.squeeze(-1), high.squeeze(-1)
        weight = None
        low_frac, high_frac = low.double(), high.double()
        has_tokens = None
    else:
        weight = mask
        tokens = mask.sum(-1)
        low_frac = (low * mask).sum(-1) / tokens.clamp(min=1)
        high_frac = (high * mask).sum(-1) / tokens.clamp(min=1)
        has_tokens = tokens > 0
    region = low | high
    for labels in (None, by) if by is not None else (None,):
        log.mean("entropy", entropies, weight=mask, by=labels)
        if kl is not None:
            log.mean("kl", kl, weight=mask, by=labels)
        log.mean("clip_ratio/low_mean", low, weight=weight, by=labels)
        log.mean("clip_ratio/high_mean", high, weight=weight, by=labels)
        log.mean("clip_ratio/region_mean", region, weight=weight, by=labels)
        log.min("clip_ratio/low_min", low_frac, mask=has_tokens, by=labels)
        log.max("clip_ratio/high_max", high_frac, mask=has_tokens, by=labels)


# the sketch metrics' name suffix, and the statistics reported of each
TOKEN_SKETCH_SUFFIX = "/_tokens"
TOKEN_QUANTILE_STATS = ("p50", "p90", "p99", "max")


def log_token_quantiles(
    log: LogMethods,
    *,
    mask: Tensor,
    entropies: Tensor,
    ratio: Tensor,
    per_token_kl: Tensor | None,
) -> None:
    """Log one micro-batch's per-token entropy, importance ratio and KL (when there is
    one) into quantile sketches: completion tokens only; one ratio per sequence when
    the ratio is per sequence (every sequence, as the clip ratios count them)."""
    log.quantile("entropy" + TOKEN_SKETCH_SUFFIX, _zero_masked(entropies.detach(), mask), mask)
    ratio = ratio.detach()
    if ratio.shape[-1] == 1:
        log.quantile("importance_ratio" + TOKEN_SKETCH_SUFFIX, ratio.squeeze(-1))
    else:
        log.quantile("importance_ratio" + TOKEN_SKETCH_SUFFIX, _zero_masked(ratio, mask), mask)
    if per_token_kl is not None:
        kl = _zero_masked(per_token_kl.detach(), mask)
        log.quantile("kl" + TOKEN_SKETCH_SUFFIX, kl, mask)


def finish_token_quantiles(results: dict[str, float]) -> dict[str, float]:
    """The sketches' results as ``<name>/{p50,p90,p99,max}``; their other keys (mean,
    std, min) are dropped (``entropy`` and ``kl`` already report exact means)."""
    out = {}
    for key, value in results.items():
        name, found, stat = key.partition(TOKEN_SKETCH_SUFFIX + "/")
        if not found:
            out[key] = value
        elif stat in TOKEN_QUANTILE_STATS:
            out[f"{name}/{stat}"] = value
    return out


def _zero_masked(values: Tensor, mask: Tensor) -> Tensor:
    """Zero the positions the mask excludes, so a NaN or inf there cannot reach a sum."""
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype))
