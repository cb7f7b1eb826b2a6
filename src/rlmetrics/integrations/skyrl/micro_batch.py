"""What one micro-batch of SkyRL's FSDP workers means, as Tracker logs.

SkyRL's ``_forward_backward_micro`` returns one float per metric and micro-batch, a mean
over that micro-batch alone, and SkyRL averages those floats with equal weights: over
micro-batches, over data-parallel ranks, over mini-batches and epochs. Micro-batches of
different sizes then weigh the same, and the padding micro-batches that token-based
batching appends (so that ranks run equally many) add their zeros to every mean. Here
each float is logged with the weight it stands for:

* token means (SkyRL's ``masked_mean`` over the micro-batch's ``loss_mask``): weight =
  the sum of the ``loss_mask``;
* sequence means (a masked mean per sequence, then the mean over the micro-batch's
  rows): weight = the rows;
* a padding micro-batch (``metadata["is_padding_batch"]``): weight 0, whatever its value.

``response_length`` is SkyRL's padded response width; here it is each sequence's number
of response tokens (its ``response_mask``), as a mean over sequences with its max and
min. Names not listed here keep SkyRL's value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rlmetrics.tracker import Tracker

POLICY_TOKEN_MEANS = frozenset(
    {
        "policy_entropy",
        "loss_metrics/clip_ratio",
        "loss_metrics/is_ratio_mean",
        "minibatch_rollout_logprobs_abs_diff_mean",
        "minibatch_rollout_logprobs_abs_diff_sq_mean",
    }
)
"""The policy metrics SkyRL computes as a ``masked_mean`` over the ``loss_mask``."""

POLICY_SEQUENCE_MEANS = frozenset({"policy_kl"})
"""The policy metrics SkyRL computes as a mean over the micro-batch's sequences."""

CRITIC_TOKEN_MEANS = frozenset({"values_mean", "values_clipfrac"})
"""The critic metrics SkyRL computes as a ``masked_mean`` over the ``loss_mask``."""

CRITIC_SEQUENCE_MEANS = frozenset({"critic_loss"})
"""The critic metrics SkyRL computes as a mean over the micro-batch's sequences."""

RESPONSE_LENGTH = "response_length"
"""The mean response length in tokens; ``_max`` and ``_min`` are added to it (the
suffixes SkyRL's own reductions take as a max and a min)."""


def is_padding(experience: Any) -> bool:
    """Whether the micro-batch is one of the padding micro-batches SkyRL's token-based
    batching appends (``loss_mask`` all 0; no real sequence)."""
    return bool((getattr(experience, "metadata", None) or {}).get("is_padding_batch", False))


def micro_batch_counts(experience: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss tokens, sequences) of a micro-batch as float64 0-d tensors on its device,
    both 0 for a padding micro-batch. No host sync."""
    mask = experience.loss_mask
    tokens = mask.sum(dtype=torch.float64)
    rows = torch.tensor(float(mask.shape[0]), dtype=torch.float64, device=mask.device)
    if is_padding(experience):
        return tokens * 0.0, rows * 0.0
    return tokens, rows


def log_micro_batch(
    tracker: Tracker,
    status: Mapping[str, Any],
    experience: Any,
    *,
    token_means: frozenset[str],
    sequence_means: frozenset[str],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log one micro-batch's SkyRL metrics with their true weights into ``tracker``.

    ``status`` is what SkyRL's ``_forward_backward_micro`` returned (its values
    unscaled: see the critic worker); names in neither set are not logged. Returns the
    micro-batch's (loss tokens, sequences), for the losses' weights.
    """
    tokens, rows = micro_batch_counts(experience)
    for name, value in status.items():
        weight = tokens if name in token_means else rows if name in sequence_means else None
        if weight is None or not isinstance(value, int | float):  # None: not computed
            continue
        value = torch.tensor(float(value), dtype=torch.float64).to(weight.device)
        tracker.mean(name, value, weight=weight)
    return tokens, rows


def log_response_lengths(tracker: Tracker, experience: Any) -> None:
    """Log each real sequence's response tokens: their mean, max and min."""
    mask = experience.response_mask
    if mask is None:
        mask = experience.loss_mask > 0
    lengths = mask.to(torch.bool).sum(-1).to(torch.float64)
    real = torch.full_like(lengths, 0.0 if is_padding(experience) else 1.0)
    tracker.mean(RESPONSE_LENGTH, lengths, weight=real)
    tracker.max(f"{RESPONSE_LENGTH}_max", lengths, weight=real)
    tracker.min(f"{RESPONSE_LENGTH}_min", lengths, weight=real)
