"""The extension for kinds with a payload beyond their slots (std's moments, dist's
values): a host extra per metric with its own merge, gathered at sync."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlmetrics.kinds.base import Kind
from rlmetrics.kinds.batch import Batch


class ExtraKind(Kind):
    """A kind whose state also holds an extra payload, neither additive nor a max.

    Implement ``reduce_extra`` and ``merge_extra`` (and ``empty_extra`` when the empty
    extra is not None); the device half (``merge_dev_extra``, ``host_extra``) and the
    packing of the payload into one gather (``extra_size``, ``extra_vector``,
    ``vector_length``, ``extra_from_vector``) have defaults: a list of batch extras, and
    an object gather. See docs/custom-kinds.md.
    """

    has_extra = True

    def reduce_extra(self, batch: Batch) -> list[Any]:
        """One batch extra per metric of ``batch``, in ``merge_dev_extra``'s format."""
        raise NotImplementedError

    def empty_extra(self) -> Any:
        """The host extra of an empty state."""
        return None

    def merge_dev_extra(self, acc_extra: Any, batch: Any) -> Any:
        """Fold a batch extra into a metric's batch extras (None when empty); the
        default keeps them in a list."""
        return [*(acc_extra or []), batch]

    def merge_extra(self, a: Any, b: Any) -> Any:
        """Merge two host extras (associative, commutative; inputs unchanged)."""
        return None

    def check_extra(self, extra: Any) -> None:
        """Check a host extra that comes from outside (a checkpoint, a merged state) for
        what ``merge_extra`` and the result cannot tell: a value this kind never makes.
        The default checks nothing.

        Raises:
            ValueError: saying what is wrong (the caller names the metric).
        """

    def host_extra(self, dev_extra: Any) -> Any:
        """Turn batch extras (host arrays or device tensors) into a host extra (may sync;
        called at step end only)."""
        return dev_extra

    def extra_size(self, extra: Any, dev_extra: Any) -> int:
        """The size of a metric's extra (host half, device half or None), known without
        a host sync; the largest across ranks sets the padded ``size`` passed to
        ``extra_vector``."""
        return 0

    def extra_vector(
        self, extra: Any, dev_extra: Any, device: torch.device, size: int
    ) -> Tensor | None:
        """A metric's whole extra (host half, device half or None) as a 1-D float64
        tensor whose length depends on ``size`` only, so ranks can all_gather it; or
        None when the extra cannot be packed (then it travels by object gather)."""
        return None

    def vector_length(self, size: int) -> int:
        """The length of ``extra_vector``'s result for a padded ``size``."""
        return 0

    def extra_from_vector(self, vector: np.ndarray) -> Any:
        """Inverse of ``extra_vector`` on the host."""
        raise NotImplementedError
