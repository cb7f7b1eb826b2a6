"""Population standard deviation with an O(1) state merged by Chan's parallel update.

State (extra): (W, mean, M2) with W = Σ w, M2 = Σ w (x - mean)^2. A step's records
reduce to one triple per metric in two passes (the mean, then the deviations from it,
corrected by their weighted sum, which holds the first pass's rounding), and two
states merge as
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

from rlmetrics.kinds.base import ResultColumns
from rlmetrics.kinds.batch import Array, Batch
from rlmetrics.kinds.extra import ExtraKind


def chan_merge(a: Array, b: Array) -> Array:
    """Merge (..., 3) arrays or tensors of (W, mean, M2) triples, triple by triple.

    An empty triple (W = 0) has mean 0 and M2 0, so merging with it returns the other
    triple exactly; no branch, so it runs on a device without a host sync.
    """
    wa, ma, m2a = a[..., 0], a[..., 1], a[..., 2]
    wb, mb, m2b = b[..., 0], b[..., 1], b[..., 2]
    w = wa + wb
    safe_w = w + (w == 0)
    delta = mb - ma
    parts = (w, ma + delta * (wb / safe_w), m2a + m2b + delta * delta * (wa * wb / safe_w))
    return torch.stack(parts, -1) if isinstance(a, Tensor) else np.stack(parts, -1)


class MomentTriples(ExtraKind):
    """Base of kinds whose state is ``num_triples`` (W, mean, M2) triples, Chan-merged.

    Each logged call is split into ``num_triples`` equal parts, one per triple; the
    states travel as float64 vectors of 3 * ``num_triples`` (one gather at sync).
    """

    num_triples = 1

    @property
    def parts(self) -> int:  # type: ignore[override]
        return self.num_triples

    def reduce_extra(self, batch: Batch) -> list[Any]:
        parts = self.num_triples
        keys = batch.segments
        if parts > 1:
            keys = keys * parts + batch.chunk_index(parts)
        size = batch.num_rows * parts
        values, weights = batch.values, batch.weights
        w = batch.sum_by(weights, keys, size)
        safe_w = batch.where(w > 0, w, 1.0)
        mean = batch.sum_by(values * weights, keys, size) / safe_w
        deviation = batch.where(weights > 0, values - mean[keys], 0.0)
        # the corrected two-pass algorithm: Σ w·deviation is the first pass's rounding
        correction = batch.sum_by(weights * deviation, keys, size)
        m2 = batch.sum_by(weights * deviation * deviation, keys, size) - correction**2 / safe_w
        mean = mean + correction / safe_w
        triples = batch.columns(w, mean, m2).reshape(batch.num_rows, 3 * parts)
        if batch.on_host:
            return [tuple(row) for row in triples.tolist()]
        return list(triples.unbind(0))

    def empty_extra(self) -> tuple[float, ...]:
        return (0.0, 0.0, 0.0) * self.num_triples

    def merge_dev_extra(self, acc_extra: Tensor | None, batch: Tensor) -> Tensor:
        if acc_extra is None:
            return batch
        return chan_merge(acc_extra.reshape(-1, 3), batch.reshape(-1, 3)).reshape(-1)

    def merge_extra(self, a: Any, b: Any) -> tuple[float, ...]:
        merged = chan_merge(np.reshape(a, (-1, 3)), np.reshape(b, (-1, 3)))
        return tuple(merged.reshape(-1).tolist())

    def check_extra(self, extra: Any) -> None:
        """Each triple's weight W is finite and >= 0 (a negative one reports NaN); the
        extra holds numbers (``state.check_metric`` checks that first)."""
        if not all(0 <= w < math.inf for w in extra[::3]):
            raise ValueError(f"a (W, mean, M2) triple's W must be finite and >= 0, got {extra!r}")

    def host_extra(self, dev_extra: Any) -> tuple[float, ...]:
        return tuple(float(x) for x in dev_extra.tolist())

    def extra_size(self, extra: Any, dev_extra: Any) -> int:
        return 1

    def extra_vector(self, extra: Any, dev_extra: Any, device: torch.device, size: int) -> Tensor:
        host = torch.from_numpy(np.array(extra, dtype=np.float64)).to(device)
        if dev_extra is None:
            return host
        return self.merge_dev_extra(host, dev_extra.to(device))

    def vector_length(self, size: int) -> int:
        return 3 * self.num_triples

    def extra_from_vector(self, vector: np.ndarray) -> tuple[float, ...]:
        return tuple(vector.tolist())


class Std(MomentTriples):
    """Population (ddof=0) standard deviation, weighted, exact when |mean| >> std.

    Examples:
        >>> from rlmetrics import Tracker
        >>> t = Tracker()
        >>> for x in (1e8 + 1, 1e8 - 1): t.std("x", x)
        >>> t.compute()["x"]
        1.0
    """

    name = "std"

    def result_columns(
        self, sums: np.ndarray, maxes: np.ndarray, extras: Any, *_: object
    ) -> ResultColumns:
        triples = np.array(extras, dtype=np.float64).reshape(-1, 3)
        w, m2 = triples[:, 0], triples[:, 2]
        present = w != 0
        return {"": np.sqrt(np.maximum(m2, 0.0) / np.where(present, w, 1.0))}, present
