"""Population standard deviation with an O(1) state merged by Chan's parallel update.

State (extra): (W, mean, M2) with W = Σ w, M2 = Σ w (x - mean)^2. Two states merge as
    delta = mean_b - mean_a;  W = W_a + W_b
    mean  = mean_a + delta * W_b / W
    M2    = M2_a + M2_b + delta^2 * W_a * W_b / W
which stays exact in float64 when |mean| >> std, unlike Σx² - (Σx)²/n.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlmetrics.kinds.base import Accumulator, Kind, MetricState

EMPTY = (0.0, 0.0, 0.0)


def chan_merge(a: tuple[float, float, float], b: tuple[float, float, float]) -> tuple:
    """Merge two (W, mean, M2) triples of python floats."""
    wa, ma, m2a = a
    wb, mb, m2b = b
    if wb == 0:
        return a
    if wa == 0:
        return b
    w = wa + wb
    delta = mb - ma
    return (w, ma + delta * (wb / w), m2a + m2b + delta * delta * (wa * wb / w))


def chan_merge_tensor(a: Tensor, b: Tensor) -> Tensor:
    """Merge two (W, mean, M2) float64 tensors of shape (3,) on device (no host sync)."""
    wa, ma, m2a = a.unbind()
    wb, mb, m2b = b.unbind()
    w = wa + wb
    safe_w = torch.where(w > 0, w, 1.0)
    delta = torch.where((wa > 0) & (wb > 0), mb - ma, 0.0)
    mean = torch.where(wa > 0, ma, mb) + torch.where(wa > 0, delta * (wb / safe_w), 0.0)
    m2 = m2a + m2b + delta * delta * (wa * wb / safe_w)
    return torch.stack((w, mean, m2))


def chan_merge_many(a: tuple, b: tuple) -> tuple:
    """Merge two flat tuples of consecutive (W, mean, M2) triples, triple by triple."""
    out: tuple = ()
    for i in range(0, len(a), 3):
        out += chan_merge(tuple(a[i : i + 3]), tuple(b[i : i + 3]))
    return out


def chan_merge_many_tensor(a: Tensor, b: Tensor) -> Tensor:
    """``chan_merge_many`` for flat float64 tensors of 3k elements, on device."""
    return torch.cat([chan_merge_tensor(x, y) for x, y in zip(a.split(3), b.split(3), strict=True)])


def moment_triple(values: Tensor, weights: Tensor | None) -> Tensor:
    """One batch's (W, mean, M2) by two passes on device: exact when |mean| >> std."""
    if weights is None:
        weights = torch.ones_like(values)
    w = weights.sum()
    mean = (values * weights).sum() / torch.where(w > 0, w, 1.0)
    deviation = torch.where(weights > 0, values - mean, 0.0)
    return torch.stack((w, mean, (weights * deviation * deviation).sum()))


def moment_triple_array(values: np.ndarray, weights: np.ndarray | None) -> tuple:
    """``moment_triple`` on host arrays, as python floats."""
    if weights is None:
        w = float(values.size)
        mean = float(values.sum()) / (w or 1.0)
        deviation = values - mean
        return (w, mean, float(np.dot(deviation, deviation)))
    w = float(weights.sum())
    mean = float(np.dot(values, weights)) / (w if w > 0 else 1.0)
    deviation = np.where(weights > 0, values - mean, 0.0)
    return (w, mean, float(np.dot(weights, deviation * deviation)))


class MomentTriples(Kind):
    """Base of kinds whose state is ``num_triples`` (W, mean, M2) triples, Chan-merged.

    A logged tensor is split into ``num_triples`` equal parts, one per triple; the
    states travel as float64 vectors of 3 * ``num_triples`` (one gather at sync).
    """

    num_sums = 0
    has_extra = True
    num_triples = 1

    def update(self, values: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor]:
        empty = values.new_empty(0)
        return empty, empty

    def add_array(self, acc: Accumulator, values: np.ndarray, weights: np.ndarray | None) -> None:
        if self.num_triples > 1:  # torch.chunk decides the parts: the tensor path
            super().add_array(acc, values, weights)
        else:
            acc.extra = chan_merge(tuple(acc.extra), moment_triple_array(values, weights))

    def empty_extra(self) -> tuple[float, ...]:
        return EMPTY * self.num_triples

    def batch_extra(self, values: Tensor, weights: Tensor | None) -> Tensor:
        parts = values.chunk(self.num_triples) if self.num_triples > 1 else (values,)
        weight_parts = (
            [None] * len(parts)
            if weights is None
            else (weights.chunk(self.num_triples) if self.num_triples > 1 else (weights,))
        )
        return torch.cat([moment_triple(v, w) for v, w in zip(parts, weight_parts, strict=True)])

    def reject_extra(self, batch: Tensor, rejected: Tensor) -> Tensor:
        return torch.where(rejected, 0.0, batch)

    def merge_dev_extra(self, acc_extra: Tensor | None, batch: Tensor) -> Tensor:
        return batch if acc_extra is None else chan_merge_many_tensor(acc_extra, batch)

    def merge_extra(self, a: Any, b: Any) -> tuple[float, ...]:
        return chan_merge_many(tuple(a), tuple(b))

    def host_extra(self, dev_extra: Tensor) -> tuple[float, ...]:
        return tuple(dev_extra.tolist())

    def extra_size(self, acc: Accumulator) -> int:
        return 1

    def extra_vector(self, acc: Accumulator | None, device: torch.device, size: int) -> Tensor:
        if acc is None:
            return torch.zeros(3 * self.num_triples, dtype=torch.float64, device=device)
        host = torch.tensor(acc.extra, dtype=torch.float64, device=device)
        if acc.dev_extra is None:
            return host
        return chan_merge_many_tensor(host, acc.dev_extra.to(device))

    def vector_length(self, size: int) -> int:
        return 3 * self.num_triples

    def extra_from_vector(self, vector: np.ndarray) -> tuple[float, ...]:
        return tuple(float(x) for x in vector)


class Std(MomentTriples):
    """Population (ddof=0) standard deviation, weighted, exact when |mean| >> std.

    Example:
        >>> from rlmetrics import Tracker
        >>> t = Tracker()
        >>> for x in (1e8 + 1, 1e8 - 1): t.std("x", x)
        >>> t.compute()["x"]
        1.0
    """

    name = "std"

    def add_float(self, acc: Accumulator, value: float, weight: float) -> None:
        if weight == 0:
            return
        w, mean, m2 = acc.extra
        w += weight
        delta = value - mean
        mean += delta * (weight / w)
        m2 += weight * delta * (value - mean)
        acc.extra = (w, mean, m2)

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        w, _, m2 = state.extra
        if w == 0:
            return None
        return {"": math.sqrt(max(m2, 0.0) / w)}
