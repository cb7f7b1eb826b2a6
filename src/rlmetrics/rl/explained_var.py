"""Explained variance 1 - Var(R - V) / Var(R) as a kind whose merge is exact.

The state is two weighted (W, mean, M2) triples, one of the returns R and one of the
residuals R - V, merged with Chan's parallel update, so the result over any split is
the whole batch's value to float64 rounding (no Σx² - (Σx)² cancellation).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlmetrics.kinds import MetricState, get_kind, register_kind
from rlmetrics.kinds.std import MomentTriples
from rlmetrics.rl.updates import MetricUpdate, bool_mask

KIND_NAME = "explained_var"


class ExplainedVar(MomentTriples):
    """Explained variance of values V for returns R, weighted (population variances).

    Log ``cat((R, R - V))`` with weights ``cat((w, w))`` (``explained_var_update`` does
    it): the first half feeds the returns' triple, the second the residuals'. The
    result is NaN when Var(R) is 0, omitted when nothing was logged.
    """

    name = KIND_NAME
    num_triples = 2

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        w_ret, _, m2_ret, w_res, _, m2_res = state.extra
        if w_ret == 0:
            return None
        var_ret = max(m2_ret, 0.0) / w_ret
        var_res = max(m2_res, 0.0) / w_res if w_res > 0 else math.nan
        if var_ret == 0:
            return {"": math.nan}
        return {"": 1.0 - var_res / var_ret}


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
