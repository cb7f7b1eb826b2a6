"""Aggregation modes: per-token losses to the mini-batch objective, and its metric.

For a mini-batch with global counts ``N`` (valid tokens) and ``S`` (sequences with a
valid token), token losses ``l[i, t]``, mask ``m`` and ``n_i = Σ_t m[i, t]``:

=========================  ==========================================
mode                       objective J
=========================  ==========================================
token-mean                 Σ_{i,t} m·l / N
token-sum                  Σ_{i,t} m·l
seq-mean-token-sum         Σ_i (Σ_t m·l) / S
seq-mean-token-mean        Σ_i (Σ_t m·l / n_i) / S
seq-mean-token-sum-norm    Σ_i (Σ_t m·l / C) / S   (C = norm_constant, fixed)
=========================  ==========================================

Each micro-batch's loss for backward is its share of J times ``grad_scale`` (dp_size
under gradient averaging), so the shares summed over micro-batches and averaged over
ranks give exactly ∇J. Its metric update is a ``mean`` whose weights sum to 1 over the
mini-batch (``m/N`` per token, or ``1/S`` per sequence) and whose weighted sum is J
(token-sum: value ``N·l`` at weight ``m/N``): merged over a step, it is the mean of the
mini-batches' objectives.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlmetrics.rl.counts import BatchCounts, resolve_counts
from rlmetrics.rl.updates import MetricUpdate, bool_mask, masked

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def check_agg(agg: str, norm_constant: float | None) -> None:
    """Validate an aggregation mode and its constant."""
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    if agg == "seq-mean-token-sum-norm" and not (
        norm_constant is not None and float(norm_constant) > 0
    ):
        raise ValueError(
            "agg='seq-mean-token-sum-norm' needs norm_constant > 0 (a fixed number such as "
            f"the maximum response length), got {norm_constant!r}"
        )


def seq_values(
    losses: Tensor, mask: Tensor, agg: str, norm_constant: float | None = None
) -> Tensor:
    """Per-sequence values of a seq-mean mode, (B,); 0 for fully masked sequences.

    seq-mean-token-mean divides by the exact token count n_i (verl adds 1e-8 to it).
    """
    sums = masked(losses, mask).sum(-1)
    if agg == "seq-mean-token-sum":
        return sums
    if agg == "seq-mean-token-mean":
        return sums / bool_mask(mask).sum(-1).clamp_min(1).to(sums.dtype)
    if agg == "seq-mean-token-sum-norm":
        if norm_constant is None:
            raise ValueError("seq_values: agg='seq-mean-token-sum-norm' needs norm_constant")
        return sums / float(norm_constant)
    raise ValueError(f"seq_values: {agg!r} is not a seq-mean mode")


def _denominator(count: Tensor | float, like: Tensor) -> Tensor | float:
    """A global count as a divisor in ``like``'s dtype (at least 1: empty -> 0 loss)."""
    if isinstance(count, Tensor):
        return count.to(device=like.device, dtype=like.dtype).clamp_min(1)
    return max(float(count), 1.0)


def aggregate(
    losses: Tensor,
    mask: Tensor,
    counts: BatchCounts | None,
    agg: str = "token-mean",
    norm_constant: float | None = None,
) -> Tensor:
    """This micro-batch's share of the objective, scaled for backward.

    Args:
        losses: per-token losses, (B, T).
        mask: valid tokens, (B, T).
        counts: the mini-batch's ``global_counts`` (None: this piece is the whole
            mini-batch on a single process).
        agg: one of ``AGG_MODES``.
        norm_constant: C of seq-mean-token-sum-norm.
    """
    check_agg(agg, norm_constant)
    counts = resolve_counts(counts, mask)
    if losses.dtype in (torch.float16, torch.bfloat16):  # counts in 8 bits would round
        losses = losses.float()
    if agg == "token-mean":
        total = masked(losses, mask).sum() / _denominator(counts.num_tokens, losses)
    elif agg == "token-sum":
        total = masked(losses, mask).sum()
    else:
        values = seq_values(losses, mask, agg, norm_constant)
        total = values.sum() / _denominator(counts.num_seqs, losses)
    return total * counts.grad_scale


def objective_update(
    name: str,
    losses: Tensor,
    mask: Tensor,
    counts: BatchCounts | None,
    agg: str = "token-mean",
    norm_constant: float | None = None,
) -> MetricUpdate:
    """The metric of ``aggregate``: the mini-batch objective, mean over optimizer steps.

    A ``mean`` update whose weights sum to 1 over the whole mini-batch (all micro-batches,
    all ranks) and whose weighted values sum to the objective J; empty micro-batches add
    nothing. ``grad_scale`` never enters.
    """
    check_agg(agg, norm_constant)
    counts = resolve_counts(counts, mask)
    losses = losses.detach()
    mask = bool_mask(mask)
    if agg in ("token-mean", "token-sum"):
        num_tokens = _denominator(counts.num_tokens, mask.double())
        values = masked(losses, mask)
        if agg == "token-sum":  # Σ (m/N)·(N·l) = Σ m·l
            values = values.double() * num_tokens
        return MetricUpdate(name, "mean", values, mask.double() / num_tokens)
    values = seq_values(losses, mask, agg, norm_constant)
    has_tokens = mask.any(-1).double()
    return MetricUpdate(
        name, "mean", values, has_tokens / _denominator(counts.num_seqs, has_tokens)
    )


def loss_update(name: str, terms: list[tuple[float, MetricUpdate]]) -> MetricUpdate:
    """The metric of a weighted sum of objectives: ``Σ_k c_k · J_k`` (e.g. ``actor/loss`` =
    pg_loss - entropy_coef · entropy_loss + kl_coef · kl_loss, as verl's ``actor/loss``).

    Each term keeps its own weights, so terms over different masks (an auxiliary loss on
    a subset of the tokens) or aggregation modes add up exactly: the update holds every
    term's elements, values ``K · c_k · v_k`` at the term's weights ``w_k`` (K terms).
    Its mean is ``Σ_k c_k J_k`` when the terms' weights have the same total, as those
    of ``objective_update`` do (1 over each mini-batch where its mask has a token; a
    mini-batch where one term's mask is empty and the others' are not reads K/(K-1)
    times the other terms' sum: log such a term as its own metric, see docs/rl.md).
    Terms that share one weight object (the same mask, counts and mode) are summed
    element-wise instead, at that weight.

    Args:
        name: the metric's name.
        terms: (coefficient, update) pairs, each update from ``objective_update`` (or a
            loss helper).

    Raises:
        ValueError: no terms, a term that is not a ``mean``, or terms on different
            devices.
    """
    if not terms:
        raise ValueError(f"loss_update {name!r}: needs at least one (coefficient, update) term")
    for _, update in terms:
        if update.kind != "mean":
            raise ValueError(
                f"loss_update {name!r}: term {update.name!r} is kind {update.kind!r}; every "
                "term must be a mean (an objective's update)"
            )
    first = terms[0][1]
    if all(update.weight is first.weight for _, update in terms):
        value = sum(float(c) * torch.as_tensor(u.value).double() for c, u in terms)
        return MetricUpdate(name, "mean", value, first.weight)
    device = torch.as_tensor(first.value).device
    values, weights = [], []
    for coefficient, update in terms:
        value = torch.as_tensor(update.value).double()
        weight = update.weight
        devices = {value.device, *(w.device for w in (weight,) if isinstance(w, Tensor))}
        if devices != {device}:
            raise ValueError(
                f"loss_update {name!r}: term {update.name!r} is on "
                f"{', '.join(map(str, sorted(devices, key=str)))}, the first term "
                f"{first.name!r} on {device}; every term must be on one device"
            )
        weight = torch.as_tensor(1.0 if weight is None else weight, device=device).double()
        value, weight = torch.broadcast_tensors(value, weight)
        values.append(value.reshape(-1) * (len(terms) * float(coefficient)))
        weights.append(weight.reshape(-1))
    return MetricUpdate(name, "mean", torch.cat(values), torch.cat(weights))
