"""``HostScratch``: the host buffers a fold writes its large temporaries into, kept
from step to step.

A host fold of float32 tensors with bool masks joins the values and the masks, then
widens the values to float64 while it zeroes the unselected ones: three arrays as large
as the step's data. Made anew each step, memory of that size may come fresh from the
system each time, a page fault per page, which costs more than the pass that writes it.
So a tracker keeps one buffer per dtype, as large as its largest fold so far, and each
fold writes into the start of it.

Nothing in a buffer outlives its fold: the kinds' reductions and extras are new arrays
(a ``Batch``'s arrays are valid while the fold runs), and a tracker folds one step at
a time (its lock). The memory kept is 13 bytes per element of the largest host fold;
a copy or a pickle of a tracker starts without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

GROWTH = 8
"""A buffer that must grow gets an eighth more than asked, so that a step size that
creeps up does not reallocate at every step."""


class HostScratch:
    """One reusable host buffer per dtype."""

    def __init__(self) -> None:
        self._buffers: dict[Any, np.ndarray] = {}

    def take(self, size: int, dtype: Any) -> np.ndarray:
        """The first ``size`` elements of the ``dtype`` buffer, which the caller may write
        over until its fold ends."""
        buffer = self._buffers.get(dtype)
        if buffer is None or len(buffer) < size:
            buffer = self._buffers[dtype] = np.empty(size + size // GROWTH, dtype)
        return buffer[:size]
