"""Global token and sequence counts of a mini-batch: the denominators of the loss."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from rlmetrics.distributed import all_reduce_sum, world_size
from rlmetrics.rl.updates import bool_mask

GRAD_REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True, slots=True)
class BatchCounts:
    """A mini-batch's counts across all data-parallel ranks.

    Attributes:
        num_tokens: valid tokens (mask true) in the whole mini-batch, all ranks.
        num_seqs: sequences with at least one valid token, all ranks. Fully masked
            sequences are not counted by any mode.
        grad_scale: the factor that undoes the gradient reduction: ``dp_size`` when
            DDP/FSDP average gradients over ranks, 1 when they sum.
    """

    num_tokens: Tensor | float
    num_seqs: Tensor | float
    grad_scale: float = 1.0


def local_counts(mask: Tensor) -> Tensor:
    """[valid tokens, sequences with a valid token] of ``mask`` (B, T), float64."""
    mask = bool_mask(mask)
    per_seq = mask.sum(-1)
    return torch.stack((per_seq.sum(), (per_seq > 0).sum())).to(torch.float64)


def global_counts(
    mask: Tensor,
    group: Any = None,
    *,
    grad_reduce: str = "mean",
    timeout: float | timedelta | None = None,
) -> BatchCounts:
    """Count a mini-batch's tokens and sequences over all ranks (one small all_reduce).

    Call it once per mini-batch, before the micro-batch loop, with this rank's whole
    share of the mini-batch. Without an initialised process group it counts locally.
    The counts stay on the device: no host sync.

    Args:
        mask: this rank's response mask for the mini-batch, (B, T).
        group: the data-parallel process group (None: the default group).
        grad_reduce: "mean" when the gradient reduction averages over ranks (DDP,
            FSDP), "sum" when it sums.
        timeout: seconds (or a timedelta) after which a missing rank raises
            ``rlmetrics.SyncTimeoutError`` (default: the group's own).
    """
    if grad_reduce not in GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduce must be one of {GRAD_REDUCTIONS}, got {grad_reduce!r}")
    counts = all_reduce_sum(local_counts(mask), group, timeout)
    world = world_size(group)
    scale = float(world) if grad_reduce == "mean" else 1.0
    return BatchCounts(counts[0], counts[1], scale)


def resolve_counts(counts: BatchCounts | None, mask: Tensor) -> BatchCounts:
    """``counts``, or, on a single process, the micro-batch's own counts.

    Raises:
        ValueError: counts is None while more than one rank is running: the local
            counts would silently give a gradient that depends on the split.
    """
    if counts is not None:
        if not isinstance(counts, BatchCounts):
            raise TypeError(f"counts must be a BatchCounts, got {type(counts).__name__}")
        return counts
    world = world_size()
    if world > 1:
        raise ValueError(
            f"counts=None with {world} ranks: pass counts=global_counts(mask, group) "
            "computed on the whole mini-batch before the micro-batch loop"
        )
    local = local_counts(mask)
    return BatchCounts(local[0], local[1], 1.0)
