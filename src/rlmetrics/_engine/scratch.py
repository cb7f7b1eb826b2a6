"""``HostScratch``: the host buffers a fold writes its large temporaries into, kept
from step to step.

A host fold of float32 tensors with bool masks joins the values and the masks, zeroes
the unselected values in place and sums them as float64 (a kind that reads the values
themselves gets them widened into a third buffer): arrays as large as the step's data.
Made anew each step, memory of that size may come fresh from the system each time, a
page fault per page, which costs more than the pass that writes it. So a tracker keeps
one buffer per dtype, as large as its recent folds need, and each fold writes into the
start of it.

Nothing in a buffer outlives its fold: the kinds' reductions and extras are new arrays
(a ``Batch``'s arrays are valid while the fold runs), and a tracker folds one step at
a time (its lock). A buffer that recent folds used little of is given back: one huge
step does not hold its memory for the rest of the run. A copy or a pickle of a tracker
starts without buffers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

GROWTH = 8
"""A buffer that must grow gets an eighth more than asked, so that a step size that
creeps up does not reallocate at every step."""

SHRINK_AFTER = 8
"""Folds in a row that use under an eighth of a buffer before it is made smaller."""


class HostScratch:
    """One reusable host buffer per dtype."""

    def __init__(self) -> None:
        self._buffers: dict[Any, np.ndarray] = {}
        self._little_used: dict[Any, int] = {}  # per dtype, folds in a row that used little

    def take(self, size: int, dtype: Any) -> np.ndarray:
        """The first ``size`` elements of the ``dtype`` buffer, which the caller may write
        over until its fold ends."""
        buffer = self._buffers.get(dtype)
        if buffer is not None and size * GROWTH < len(buffer):
            little = self._little_used[dtype] = self._little_used.get(dtype, 0) + 1
            if little >= SHRINK_AFTER:
                buffer = None  # given back: recent folds need far less
        else:
            self._little_used[dtype] = 0
        if buffer is None or len(buffer) < size:
            buffer = self._buffers[dtype] = np.empty(size + size // GROWTH, dtype)
            self._little_used[dtype] = 0
        return buffer[:size]
