"""Distribution: keeps every element; results mean, std, min, max and exact quantiles."""

from __future__ import annotations

import math
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlmetrics.kinds.base import MetricState
from rlmetrics.kinds.batch import Batch
from rlmetrics.kinds.extra import ExtraKind

DEFAULT_QUANTILES = (0.5, 0.9, 0.99)


def quantile_suffix(q: float) -> str:
    """0.5 -> 'p50', 0.999 -> 'p99.9', 0.9999999 -> 'p99.99999': the percentage written
    from q's shortest repr, exactly, so that distinct quantiles get distinct labels."""
    return f"p{Decimal(repr(float(q))).scaleb(2).normalize():f}"


def check_quantiles(quantiles: Sequence[float], owner: str) -> tuple[float, ...]:
    """``quantiles`` as floats, each in [0, 1] and distinct (one label each).

    Raises:
        ValueError: naming ``owner`` and the offending quantile.
    """
    checked = tuple(float(q) for q in quantiles)
    for q in checked:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"{owner} quantiles must lie in [0, 1], got {q!r}")
    repeated = sorted({q for q in checked if checked.count(q) > 1})
    if repeated:
        raise ValueError(f"{owner} quantiles must be distinct, got {repeated[0]!r} repeated")
    return checked


class Dist(ExtraKind):
    """Every element logged, concatenated on merge (O(n) memory, by design).

    Results: ``name/mean``, ``name/std`` (population), ``name/min``, ``name/max`` and
    one ``name/pXX`` per quantile, exactly as numpy computes them on the whole batch
    (numpy's default 'linear' quantile method).

    Examples:
        >>> from rlmetrics import Tracker
        >>> t = Tracker()
        >>> t.dist("len", [1, 2, 3, 4])
        >>> t.compute()["len/p50"]
        2.5
    """

    name = "dist"
    sum_columns = ("selected",)  # elements kept

    def __init__(self, quantiles: Sequence[float] = DEFAULT_QUANTILES) -> None:
        self.quantiles = check_quantiles(quantiles, "dist")

    def reduce_extra(self, batch: Batch) -> list[Any]:
        """Per metric, its selected values on the host (views of one new array of every
        selected value); on a device, its (values, selected) pieces: the selection is
        applied on the host after the transfer, which a device cannot do without a sync."""
        if batch.on_host:
            kept = np.compress(batch.selected(), batch.values)
            counts = batch.count().astype(np.int64)
            return [[piece] for piece in np.split(kept, np.cumsum(counts[:-1]))]
        return list(zip(batch.split(batch.values), batch.split(batch.selected()), strict=True))

    def empty_extra(self) -> list:
        return []

    def merge_extra(self, a: Any, b: Any) -> list:
        values = np.concatenate((as_array(a), as_array(b)))
        return [values] if values.size else []

    def extra_size(self, extra: Any, dev_extra: Any) -> int:
        """Elements stored, kept or not (known without a host sync)."""
        return as_array(extra).size + sum(v.numel() for v, _ in dev_extra or [])

    def extra_vector(self, extra: Any, dev_extra: Any, device: torch.device, size: int) -> Tensor:
        """[values..., keep flags...], each half padded to ``size`` with dropped slots;
        filtering happens on the host after the transfer (no sync here)."""
        values = [torch.as_tensor(as_array(extra), device=device)]
        keeps = [torch.ones(values[0].numel(), dtype=torch.float64, device=device)]
        for batch_values, kept in dev_extra or []:
            values.append(batch_values.to(device))
            keeps.append(
                torch.ones(batch_values.numel(), dtype=torch.float64, device=device)
                if kept is None
                else kept.to(device, torch.float64)
            )
        padding = torch.zeros(
            size - sum(v.numel() for v in values), dtype=torch.float64, device=device
        )
        return torch.cat([*values, padding, *keeps, padding])

    def vector_length(self, size: int) -> int:
        return 2 * size

    def extra_from_vector(self, vector: np.ndarray) -> list:
        n = vector.size // 2
        return [vector[:n][vector[n:] > 0]]

    def host_extra(self, dev_extra: Any) -> list:
        return [_host(v)[_host(kept)].astype(np.float64) for v, kept in dev_extra or []]

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        values = as_array(state.extra)
        if values.size == 0:
            return None
        with np.errstate(invalid="ignore"):  # inf - inf under nonfinite="propagate"
            low, high = float(values.min()), float(values.max())
            out = {
                "mean": float(values.mean()),
                "std": _std(values, max(-low, high)),
                "min": low,
                "max": high,
            }
            quantiles = np.quantile(values, self.quantiles) if self.quantiles else []
        for q, value in zip(self.quantiles, quantiles, strict=True):
            out[quantile_suffix(q)] = float(value)
        return out

    def result_names(self) -> tuple[str, ...]:
        return ("mean", "std", "min", "max", *map(quantile_suffix, self.quantiles))

    def config(self) -> tuple:
        return (self.quantiles,)

    def __repr__(self) -> str:
        return f"Dist(quantiles={self.quantiles!r})"


def _host(x: Any) -> np.ndarray:
    return x.cpu().numpy() if isinstance(x, Tensor) else x


def as_array(extra: Any) -> np.ndarray:
    """A dist extra (a list of floats and arrays, or an array) as one float64 array."""
    if extra is None:
        return np.zeros(0)
    if isinstance(extra, np.ndarray):
        return extra.astype(np.float64, copy=False).ravel()
    scalars = [x for x in extra if not isinstance(x, np.ndarray)]
    arrays = [x.astype(np.float64, copy=False).ravel() for x in extra if isinstance(x, np.ndarray)]
    return np.concatenate([np.asarray(scalars, dtype=np.float64), *arrays])


# Above this magnitude the squares in a standard deviation overflow float64.
_SQUARE_LIMIT = 1e150


def _std(values: np.ndarray, scale: float) -> float:
    """The population standard deviation of a non-empty array whose largest magnitude is
    ``scale``; values large enough for their squares to overflow are divided by it
    first, so a finite spread is reported as finite."""
    if not scale > _SQUARE_LIMIT or scale == math.inf:
        return float(values.std())
    return scale * float((values / scale).std())
