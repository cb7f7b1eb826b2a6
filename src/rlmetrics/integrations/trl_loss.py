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
- ``cispo_clip_ratio`` (``cispo``): the fraction of tokens whose ratio was capped, token
  weighted; ``vespo/phi_seq_mean`` (``vespo``): the mean, over the window's sequences, of
  each sequence's gamma weight. Clip ratios are logged for the clipped loss types only
  (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``), as TRL does.
- ``loss``: what the loss type averages, over the whole window: per-sequence token means
  averaged over sequences (``grpo``, ``sapo``), per-sequence token sums over
  ``max_completion_length`` averaged over sequences (``dr_grpo``), per-sequence token
  sums averaged over sequences (``luspo``), a token mean (``dapo``, ``cispo``,
  ``vespo``). ``bnpo`` averages token means of micro-batches, so its loss (and its
  gradient) depends on the micro-batch size; it is logged as such, with a warning.
  The policy part is logged as ``policy_loss``; ``finish_loss`` adds the terms TRL adds
  per micro-batch (the entropy bonus, the MoE load-balancing loss), each a mean over the
  window's micro-batches, as the objective weighs them.

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

from rlmetrics.tracker import LogTarget

# the loss types whose loss this module computes (and TRL 1.16 computes the same way)
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# those with a clipped surrogate, whose clip ratios TRL logs
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# the loss types normalised by the tokens of the whole optimizer step
TOKEN_SUM_LOSS_TYPES = ("dapo", "cispo", "vespo")

# the policy part of the loss, as logged (the loss type's aggregate, over the window)
POLICY_LOSS = "policy_loss"
# hidden: each micro-batch's entropy bonus (its coefficient times its token mean of
# entropy), averaged over the window's micro-batches
ENTROPY_BONUS = "loss/_entropy_bonus"
# each micro-batch's MoE load-balancing loss, averaged over the window's micro-batches
AUX_LOSS = "aux_loss"


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
        sapo_temperature_pos: ``sapo``'s gate temperature for positive advantages.
        sapo_temperature_neg: ``sapo``'s gate temperature for the others.
    """

    loss_type: str
    beta: float
    epsilon_low: float
    epsilon_high: float
    delta: float | None
    importance_sampling_level: str
    use_bias_correction_kl: bool
    max_completion_length: int
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05

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
        dapo_tokens: the divisor of ``dapo``, ``cispo`` and ``vespo``: the tokens one
            optimizer step's share of the generation batch holds on this process
            (unused by other loss types).
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
    ratio: Tensor,
    advantages: Tensor,
    config: LossConfig,
    per_token_kl: Tensor | None,
    *,
    per_token_logps: Tensor,
    gamma_weights: Tensor | None = None,
    keep: Sequence[Tensor] = (),
) -> Tensor:
    """TRL's per-token loss (to minimise): the loss type's policy term, times each mask
    of ``keep`` (the off-policy and the high-entropy masks), plus ``beta`` times the KL.

    ``cispo`` and ``vespo`` weigh the log-probabilities (``per_token_logps``); ``vespo``
    by its gamma weights (``gamma_weights``, one per sequence, from TRL).

    Raises:
        ValueError: ``vespo`` without its gamma weights.
    """
    loss = _policy_term(ratio, advantages, config, per_token_logps, gamma_weights)
    for mask in keep:
        loss = loss * mask
    if per_token_kl is not None:
        loss = loss + config.beta * per_token_kl
    return loss


def _policy_term(
    ratio: Tensor,
    advantages: Tensor,
    config: LossConfig,
    per_token_logps: Tensor,
    gamma_weights: Tensor | None,
) -> Tensor:
    if config.loss_type == "cispo":
        capped = torch.clamp(ratio, max=config.epsilon_high).detach()
        return -capped * advantages * per_token_logps
    if config.loss_type == "sapo":
        temperatures = torch.where(
            advantages > 0, config.sapo_temperature_pos, config.sapo_temperature_neg
        )
        gate = torch.sigmoid(temperatures * (ratio - 1)) * 4 / temperatures
        return -gate * advantages
    if config.loss_type == "vespo":
        if gamma_weights is None:
            raise ValueError("loss_type='vespo' needs the gamma weights of its sequences")
        return -gamma_weights * advantages * per_token_logps
    clipped = torch.clamp(ratio, 1 - config.epsilon_low, 1 + config.epsilon_high)
    if config.delta is not None:
        ratio = torch.clamp(ratio, max=config.delta)
    return -torch.min(ratio * advantages, clipped * advantages)


def aggregate_loss(
    per_token_loss: Tensor, mask: Tensor, config: LossConfig, scale: Normalizer, log: LogTarget
) -> Tensor:
    """The micro-batch's loss for backward; logs its value as ``policy_loss`` with its
    meaning's weights."""
    masked = per_token_loss * mask
    loss_type = config.loss_type
    if loss_type in ("grpo", "sapo"):
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
        log.mean(POLICY_LOSS, per_seq.detach())
        return per_seq.mean() / scale.accumulation_steps
    if loss_type == "dr_grpo":
        per_seq = masked.sum(-1) / config.max_completion_length
        log.mean(POLICY_LOSS, per_seq.detach())
        return per_seq.mean() / scale.accumulation_steps
    if loss_type == "luspo":
        per_seq = masked.sum(-1)
        log.mean(POLICY_LOSS, per_seq.detach())
        return per_seq.mean() / scale.accumulation_steps
    if loss_type == "bnpo":
        micro = masked.sum() / mask.sum().clamp(min=1.0)
        log.mean(POLICY_LOSS, micro.detach())  # one value per micro-batch: split-dependent
        return micro / scale.accumulation_steps
    # dapo, cispo, vespo: a token mean over the optimizer step
    token_loss = _zero_masked(per_token_loss.detach(), mask)
    log.mean(POLICY_LOSS, token_loss, weight=mask)
    return masked.sum() / scale.dapo_tokens


def log_extra_loss_terms(
    log: LogTarget, *, entropy_bonus: Tensor | None, aux_loss: Tensor | None
) -> None:
    """Log the terms TRL adds to one micro-batch's loss, one value per micro-batch (the
    weight each has in the objective): the entropy bonus, its coefficient applied
    (subtracted), and the MoE load-balancing loss (added, times its coefficient)."""
    if entropy_bonus is not None:
        log.mean(ENTROPY_BONUS, entropy_bonus.detach())
    if aux_loss is not None:
        log.mean(AUX_LOSS, aux_loss.detach())


def finish_loss(results: dict[str, float], *, aux_loss_coef: float) -> dict[str, float]:
    """``loss`` from its logged parts, as the objective sums them: ``policy_loss`` minus
    the entropy bonus plus ``aux_loss_coef`` times ``aux_loss``. ``policy_loss`` stays
    a key when there is an entropy bonus (TRL logs it then), else it is ``loss``."""
    out = dict(results)
    bonus = out.pop(ENTROPY_BONUS, None)
    policy = out.pop(POLICY_LOSS, None)
    if policy is None:
        return out
    loss = policy
    if bonus is not None:
        out[POLICY_LOSS] = policy
        loss = loss - bonus
    if AUX_LOSS in out:
        loss = loss + aux_loss_coef * out[AUX_LOSS]
    out["loss"] = loss
    return out


def log_policy_metrics(
    log: LogTarget,
    *,
    mask: Tensor,
    entropies: Tensor,
    ratio: Tensor,
    advantages: Tensor,
    per_token_kl: Tensor | None,
    config: LossConfig,
    gamma_weights: Tensor | None = None,
    by: Sequence[str] | None = None,
) -> None:
    """Log entropy, KL and the loss type's own metrics of one micro-batch (device
    tensors, no sync): the clip ratios, ``cispo_clip_ratio`` or ``vespo/phi_seq_mean``.
    With ``by`` (one label per sequence), entropy, KL and the clip ratios also per label."""
    entropies = _zero_masked(entropies.detach(), mask)
    kl = None if per_token_kl is None else _zero_masked(per_token_kl.detach(), mask)
    ratio = ratio.detach()
    per_sequence = ratio.shape[-1] == 1  # one ratio per sequence: each sequence weighs 1
    for labels in (None, by) if by is not None else (None,):
        log.mean("entropy", entropies, weight=mask, by=labels)
        if kl is not None:
            log.mean("kl", kl, weight=mask, by=labels)
        if config.loss_type in CLIPPED_LOSS_TYPES:
            _log_clip_ratios(log, mask, ratio, advantages, config, labels)
    if config.loss_type == "cispo":
        capped = (ratio > config.epsilon_high) & (advantages > 0)
        if per_sequence:
            log.mean("cispo_clip_ratio", capped.squeeze(-1))
        else:
            log.mean("cispo_clip_ratio", capped, weight=mask)
    if gamma_weights is not None:
        log.mean("vespo/phi_seq_mean", gamma_weights.detach().squeeze(-1))


def _log_clip_ratios(
    log: LogTarget,
    mask: Tensor,
    ratio: Tensor,
    advantages: Tensor,
    config: LossConfig,
    labels: Sequence[str] | None,
) -> None:
    """The clip ratios of the clipped loss types, of the ratio as the loss used it
    (capped at ``delta`` when set, as TRL counts it)."""
    if config.delta is not None:
        ratio = torch.clamp(ratio, max=config.delta)
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
    log.mean("clip_ratio/low_mean", low, weight=weight, by=labels)
    log.mean("clip_ratio/high_mean", high, weight=weight, by=labels)
    log.mean("clip_ratio/region_mean", region, weight=weight, by=labels)
    log.min("clip_ratio/low_min", low_frac, mask=has_tokens, by=labels)
    log.max("clip_ratio/high_max", high_frac, mask=has_tokens, by=labels)


# the sketch metrics' name suffix, and the statistics reported of each
TOKEN_SKETCH_SUFFIX = "/_tokens"
TOKEN_QUANTILE_STATS = ("p50", "p90", "p99", "max")


def log_token_quantiles(
    log: LogTarget,
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
