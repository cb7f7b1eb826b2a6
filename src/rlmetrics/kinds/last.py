"""Last / replicated: the latest value on a rank; across ranks, values must agree.

State: sums (Σ v, number of sources), maxes (v, -v). A new value on a rank replaces the
rank's state; merging adds sources, so disagreement shows as max != min, without a
gather.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from rlmetrics.kinds.base import NUM_FLAGS, Accumulator, Kind, MetricState, ResultFormula
from rlmetrics.kinds.batch import Array, Batch

_warned: set[str] = set()


class Last(Kind):
    """A replicated value (learning rate, KL coefficient): the value in effect.

    Example:
        >>> from rlmetrics import Tracker
        >>> t = Tracker()
        >>> t.last("lr", 1e-3); t.last("lr", 2e-3)
        >>> t.compute()["lr"]
        0.002
    """

    name = "last"
    num_sums = 2
    num_maxes = 2
    # state: [Σ v, sources, v, -v]; ranks that disagree go through ``result`` (it warns)
    result_formula = ResultFormula(value=2, present=1, negated_copy=3)
    replaces = True

    def reduce(self, batch: Batch) -> tuple[Array, Array]:
        value, present = batch.last_by(batch.values)
        high = batch.where(present > 0, value, -math.inf)
        neg_low = batch.where(present > 0, -value, -math.inf)
        return batch.columns(value, present), batch.columns(high, neg_low)

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        total, sources = state.sums
        if sources == 0:
            return None
        high, neg_low = state.maxes
        if high == -neg_low or math.isnan(high):
            return {"": high}
        if name not in _warned:
            _warned.add(name)
            warnings.warn(
                f"metric {name!r} (kind 'last'): merged values disagree "
                f"(min {-neg_low!r}, max {high!r}, {sources:g} sources); reporting their mean",
                RuntimeWarning,
                stacklevel=2,
            )
        return {"": total / sources}


def replace_dev(
    acc: Accumulator,
    sums: Tensor,
    maxes: Tensor,
    keep_old: Tensor | None,
    flags: Tensor | None = None,
) -> None:
    """Make a device value the rank's latest, unless ``keep_old`` (device bool) is set.

    ``sums`` are the kind's own (no framework flags); ``flags`` are added to the
    accumulated ones. The host half is folded into the device half so that "latest"
    spans both.
    """
    device = sums.device
    if not acc.kept_call and not acc.host_empty():
        acc.kept_call = True  # the host value folded below came from a python call
    old_sums = _on_device(acc.sums, sums)
    old_flags = sums.new_zeros(NUM_FLAGS)
    if acc.dev_sums is not None:
        dev_sums = acc.dev_sums.to(device)
        old_sums = old_sums + dev_sums[:-NUM_FLAGS]
        old_flags = dev_sums[-NUM_FLAGS:]
    old_maxes = _on_device(acc.maxes, maxes)
    if acc.dev_maxes is not None:
        old_maxes = torch.maximum(old_maxes, acc.dev_maxes.to(device))
    new_values = sums
    if keep_old is not None:
        new_values = torch.where(keep_old, old_sums, new_values)
        maxes = torch.where(keep_old, old_maxes, maxes)
    acc.dev_sums = torch.cat((new_values, old_flags if flags is None else old_flags + flags))
    acc.dev_maxes = maxes
    acc.sums[:] = [0.0] * len(acc.sums)
    acc.maxes[:] = [-math.inf] * len(acc.maxes)


def _on_device(values: list[float], like: Tensor) -> Tensor:
    """Host floats as a float64 tensor on ``like``'s device, built by fills: on CUDA,
    ``torch.tensor(values, device=...)`` would be a blocking host-to-device copy."""
    return torch.stack([like.new_full((), value, dtype=torch.float64) for value in values])
