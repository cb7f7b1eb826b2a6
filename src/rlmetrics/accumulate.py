"""One log call's data into a metric's accumulator: python numbers and host data (CPU
tensors, numpy arrays, lists) on the host with numpy, device tensors with torch ops on
their device, under the same rules.

Checks that need no data (types, shapes, dtypes, python values) raise in the call.
Data checks (negative or non-finite weights, non-finite values under
``nonfinite="error"``) reject the call instead: it contributes nothing and is counted,
and ``compute()`` reports it. On the device that count is a flag computed there, so
the host never waits; the host path keeps the same rule so that a CPU test behaves as
the GPU run.

An element with weight 0 contributes nothing, whatever its value and under every
``nonfinite`` policy: a NaN or inf there is neither counted nor rejected, and never
reaches the arithmetic (``NaN * 0`` is NaN), because its value is replaced by 0 first.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from rlmetrics.inputs import (
    as_number,
    as_tensor,
    as_weights,
    check_weight_number,
    host_array,
    host_weights,
    in_host_memory,
    unmask,
)
from rlmetrics.kinds import Accumulator, Kind
from rlmetrics.kinds.base import NONFINITE_SLOT, REJECTED_SLOT
from rlmetrics.kinds.last import replace_dev

BOOL_DTYPES = (torch.bool, np.dtype(bool))


def add_number(acc: Accumulator, name: str, value: float, weight: float, nonfinite: str) -> None:
    """One python number (checked here and now: it is on the host)."""
    if weight != 1.0:
        check_weight_number(name, weight)
        if weight == 0.0:  # contributes nothing, NaN or not, under every policy
            acc.kept_call = True  # but the metric exists (see Tracker._forget_rejected)
            return
    if nonfinite != "propagate" and not math.isfinite(value):
        if nonfinite == "error":
            raise ValueError(f"metric {name!r}: non-finite value {value!r} (nonfinite='error')")
        acc.count(NONFINITE_SLOT)
        return
    acc.kind.add_float(acc, value, weight)


class Prepared(NamedTuple):
    """One log call's value and weight, converted and checked once (``prepare``); it may
    feed several metrics (``Tracker.log_shared``)."""

    number: float | None  # a python number with a python weight: the number path
    weight_number: float
    values: np.ndarray | Tensor | None  # 1-D float64, host or device (else None)
    weights: np.ndarray | Tensor | None
    shape: tuple[int, ...]  # of the value as logged, for messages
    check_weights: bool  # weights are an array that is not a bool mask


def prepare(name: str, value: Any, weight: Any, *, host_arrays: bool) -> Prepared:
    """Convert any value (number, array, tensor) and weight: python numbers stay numbers,
    host data becomes numpy arrays (unless ``host_arrays`` is False), device tensors stay
    on their device. Checks that need no data raise here, naming ``name``."""
    if isinstance(value, np.ma.MaskedArray) or isinstance(weight, np.ma.MaskedArray):
        value, weight = unmask(name, value, weight)
    # a tensor is never a number (0-d ones included: reading one would sync)
    number = None if isinstance(value, Tensor) else as_number(name, value)
    weight_number = None
    if weight is not None and not isinstance(weight, Tensor):
        weight_number = as_number(name, weight, "weight")
    if number is not None and (weight is None or weight_number is not None):
        weight_number = 1.0 if weight_number is None else weight_number
        return Prepared(number, weight_number, None, None, (), False)
    # bool masks are valid weights by construction: only other arrays need data checks
    check = weight_number is None and getattr(weight, "dtype", None) not in BOOL_DTYPES
    if host_arrays and in_host_memory(value) and in_host_memory(weight):
        values = np.array(number) if number is not None else host_array(name, value)
        weights = host_weights(name, weight, values)
        flat = None if weights is None else weights.ravel()
        return Prepared(None, 1.0, values.ravel(), flat, values.shape, check)
    if number is not None:
        device = weight.device if isinstance(weight, Tensor) else None
        # torch.full, not torch.tensor: on CUDA the latter is a blocking copy
        values = torch.full((), number, dtype=torch.float64, device=device)
    else:
        values = as_tensor(name, value)
    weights = as_weights(name, weight, values)
    shape = tuple(values.shape)
    values = values if values.dim() == 1 else values.reshape(-1)
    if weights is not None and weights.dim() != 1:
        weights = weights.reshape(-1)
    return Prepared(None, 1.0, values, weights, shape, check)


def add_prepared(acc: Accumulator, name: str, prepared: Prepared, nonfinite: str) -> None:
    """Accumulate a prepared value into ``acc`` (the metric called ``name``)."""
    values = prepared.values
    if values is None:
        add_number(acc, name, prepared.number, prepared.weight_number, nonfinite)
        return
    if acc.kind.replaces and len(values) != 1:
        raise ValueError(
            f"metric {name!r} (kind {acc.kind.name!r}) takes one value, got shape {prepared.shape}"
        )
    if prepared.check_weights or nonfinite == "error":
        acc.num_checked += 1  # may be rejected: compute() tells
    else:
        acc.kept_call = True
    add = add_array if isinstance(values, np.ndarray) else add_tensor
    add(acc, values, prepared.weights, nonfinite, check_weights=prepared.check_weights)


def add_array(
    acc: Accumulator,
    values: np.ndarray,
    weights: np.ndarray | None,
    nonfinite: str,
    *,
    check_weights: bool,
) -> None:
    """Accumulate host data (1-D float64 arrays) with numpy, with the tensor path's
    rules: a rejected call is dropped and counted (reported at step end, as for
    tensors)."""
    if weights is not None:
        low, high = (weights.min(), weights.max()) if check_weights and weights.size else (0, 0)
        if not (low >= 0 and high < math.inf):  # NaN fails both
            acc.count(REJECTED_SLOT)
            return
        # x·x has no cancellation: it is finite only when every x is (or on overflow)
        if not math.isfinite(np.dot(values, values)):
            values = np.where(weights > 0, values, 0.0)  # weight 0: nothing, NaN included
    if nonfinite != "propagate":
        finite = np.isfinite(values)
        if not finite.all():
            if nonfinite == "error":
                acc.count(REJECTED_SLOT)
                return
            acc.count(NONFINITE_SLOT, float(values.size - np.count_nonzero(finite)))
            if acc.kind.replaces:
                return
            values = np.where(finite, values, 0.0)
            weights = np.where(finite, 1.0 if weights is None else weights, 0.0)
    with np.errstate(all="ignore"):  # inf and NaN give what the arithmetic gives
        acc.kind.add_array(acc, values, weights)


class Screened(NamedTuple):
    """A tensor call after its data checks, as device tensors (see ``screen``)."""

    values: Tensor
    weights: Tensor | None
    rejected: Tensor | None  # bool: drop the whole call
    num_nonfinite: Tensor | None  # non-finite elements skipped (0 when rejected)
    keep_old: Tensor | None  # bool, replacing kinds: keep the previous value


def screen(
    kind: Kind, values: Tensor, weights: Tensor | None, nonfinite: str, check_weights: bool
) -> Screened:
    """Apply the weight and non-finite rules to one tensor call on its device (no sync).

    Weight-0 elements contribute nothing, NaN included (``NaN * 0`` is NaN): their values
    become 0 before a multiplying kind (or any check) sees them; selecting kinds
    (``takes_weight`` False) select weight > 0 themselves.
    """
    rejected = keep_old = num_nonfinite = None
    if weights is not None:
        if check_weights:
            rejected = ~((weights >= 0) & (weights < math.inf)).all()  # NaN fails both
        if kind.takes_weight or nonfinite != "propagate":
            values = torch.where(weights > 0, values, 0.0)
        if kind.replaces:  # a replacing kind's one value, deselected: the old one stays
            keep_old = ~(weights[-1] > 0)
    if nonfinite == "skip":
        finite = torch.isfinite(values)
        num_nonfinite = (~finite).sum().double()
        values = torch.where(finite, values, 0.0)
        weights = finite.double() if weights is None else torch.where(finite, weights, 0.0)
        if kind.replaces:
            keep_old = ~finite.all() if keep_old is None else keep_old | ~finite.all()
    elif nonfinite == "error":
        bad = ~torch.isfinite(values).all()
        rejected = bad if rejected is None else rejected | bad
    if num_nonfinite is not None and rejected is not None:
        num_nonfinite = torch.where(rejected, 0.0, num_nonfinite)  # a dropped call counts once
    return Screened(values, weights, rejected, num_nonfinite, keep_old)


def add_tensor(
    acc: Accumulator,
    values: Tensor,
    weights: Tensor | None,
    nonfinite: str,
    *,
    check_weights: bool,
) -> None:
    """Accumulate 1-D float64 tensors on their device; data checks become device flags
    (no host sync).

    A rejected call (bad weights; non-finite values under "error") is zeroed by
    ``where`` on its outputs, whatever they hold, and counted in the flags.
    """
    kind = acc.kind
    values, weights, rejected, num_nonfinite, keep_old = screen(
        kind, values, weights, nonfinite, check_weights
    )
    sums, maxes = kind.update(values, weights)
    flags = None
    if num_nonfinite is not None or rejected is not None:
        zero = sums.new_zeros(())
        flags = torch.stack(
            (
                zero if num_nonfinite is None else num_nonfinite,
                zero if rejected is None else rejected.double(),
            )
        )
    if rejected is not None:
        sums = torch.where(rejected, 0.0, sums)
        maxes = torch.where(rejected, -math.inf, maxes)
        keep_old = rejected if keep_old is None else keep_old | rejected
    if kind.replaces:
        replace_dev(acc, sums, maxes, keep_old, flags)
    else:
        acc.add_dev(sums, maxes, flags)
    if kind.has_extra:
        batch = kind.batch_extra(values, weights)
        if rejected is not None:
            batch = kind.reject_extra(batch, rejected)
        acc.dev_extra = kind.merge_dev_extra(acc.dev_extra, batch)
