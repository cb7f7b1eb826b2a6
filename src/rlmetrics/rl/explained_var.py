"""Explained variance 1 - Var(R - V) / Var(R) as a kind whose merge is exact.

The state is two weighted (W, mean, M2) triples, one of the returns R and one of the
residuals R - V, merged with Chan's parallel update, so the result over any split is
the whole batch's value to float64 rounding (no Σx² - (Σx)² cancellation).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlmetrics.kinds import Accumulator, Kind, MetricState, get_kind, register_kind
from rlmetrics.kinds.std import EMPTY, Std, chan_merge, chan_merge_tensor
from rlmetrics.rl.updates import MetricUpdate, bool_mask

KIND_NAME = "explained_var"


class ExplainedVar(Kind):
    """Explained variance of values V for returns R, weighted (population variances).

    Log ``cat((R, R - V))`` with weights ``cat((w, w))`` (``explained_var_update`` does
    it). The result is NaN when Var(R) is 0, omitted when nothing was logged.
    """

    name = KIND_NAME
    num_sums = 0
    has_extra = True

    def update(self, values: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor]:
        empty = values.new_empty(0)
        return empty, empty

    def add_float(self, acc: Accumulator, value: float, weight: float) -> None:
        raise TypeError(
            f"kind {KIND_NAME!r} takes a tensor cat((returns, returns - values)), got a number"
        )

    def empty_extra(self) -> tuple[float, ...]:
        return EMPTY + EMPTY

    def batch_extra(self, values: Tensor, weights: Tensor | None) -> Tensor:
        if weights is None:
            weights = torch.ones_like(values)
        half = values.numel() // 2
        triple = Std().batch_extra
        return torch.cat(
            (triple(values[:half], weights[:half]), triple(values[half:], weights[half:]))
        )

    def reject_extra(self, batch: Tensor, rejected: Tensor) -> Tensor:
        return torch.where(rejected, 0.0, batch)

    def merge_dev_extra(self, acc_extra: Tensor | None, batch: Tensor) -> Tensor:
        return batch if acc_extra is None else _merge_tensor(acc_extra, batch)

    def merge_extra(self, a: Any, b: Any) -> tuple[float, ...]:
        a, b = tuple(a), tuple(b)
        return chan_merge(a[:3], b[:3]) + chan_merge(a[3:], b[3:])

    def host_extra(self, dev_extra: Tensor) -> tuple[float, ...]:
        return tuple(dev_extra.tolist())

    def extra_size(self, acc: Accumulator) -> int:
        return 1

    def extra_vector(self, acc: Accumulator | None, device: torch.device, size: int) -> Tensor:
        if acc is None:
            return torch.zeros(6, dtype=torch.float64, device=device)
        host = torch.tensor(acc.extra, dtype=torch.float64, device=device)
        if acc.dev_extra is None:
            return host
        return _merge_tensor(host, acc.dev_extra.to(device))

    def vector_length(self, size: int) -> int:
        return 6

    def extra_from_vector(self, vector: np.ndarray) -> tuple[float, ...]:
        return tuple(float(x) for x in vector)

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        w_ret, _, m2_ret, w_res, _, m2_res = state.extra
        if w_ret == 0:
            return None
        var_ret = max(m2_ret, 0.0) / w_ret
        var_res = max(m2_res, 0.0) / w_res if w_res > 0 else math.nan
        if var_ret == 0:
            return {"": math.nan}
        return {"": 1.0 - var_res / var_ret}


def _merge_tensor(a: Tensor, b: Tensor) -> Tensor:
    return torch.cat((chan_merge_tensor(a[:3], b[:3]), chan_merge_tensor(a[3:], b[3:])))


def explained_var_update(
    returns: Tensor, values: Tensor, mask: Tensor, name: str = "critic/vf_explained_var"
) -> MetricUpdate:
    """Explained variance over valid tokens (weight 1 per token), merged exactly."""
    mask = bool_mask(mask)
    zero = returns.new_zeros(())
    ret = torch.where(mask, returns.detach(), zero).reshape(-1)
    res = torch.where(mask, (returns - values).detach(), zero).reshape(-1)
    weight = mask.reshape(-1).double()
    return MetricUpdate(name, KIND_NAME, torch.cat((ret, res)), torch.cat((weight, weight)))


def ensure_registered() -> None:
    """Register the kind once (importing rlmetrics.rl does it)."""
    try:
        get_kind(KIND_NAME)
    except ValueError:
        register_kind(ExplainedVar())
