"""The exceptions rlmetrics raises for users to catch; all exported from ``rlmetrics``.

``ModifiedInputError``: a logged tensor was changed in place before the step's end.
``RejectedInputError``: tensor log calls were rejected on the device and dropped.
``SyncTimeoutError``: a collective of the sync did not complete within the timeout.
``MalformedStateError``: a ``state_dict`` that cannot be loaded (damaged or foreign).
``TokenCountError``: a tensor token count of ``throughput()`` was negative or not finite.
"""

from __future__ import annotations


class ModifiedInputError(ValueError):
    """A logged tensor was changed in place before the step's end. ``calls``: the calls
    dropped per metric, where the metric is known (empty for calls with ``by=``)."""

    def __init__(self, message: str, calls: dict[str, int] | None = None) -> None:
        super().__init__(message)
        self.calls = calls or {}


class RejectedInputError(ValueError):
    """Tensor log calls were rejected on the device (negative or non-finite weights, or
    non-finite values under ``nonfinite="error"``), or changed in place on some rank,
    and dropped; raised at step end, on every rank of a sync."""


class SyncTimeoutError(RuntimeError):
    """A collective did not complete within the timeout (a rank died or hangs)."""


class MalformedStateError(ValueError):
    """A ``state_dict`` that cannot be loaded: damaged, foreign (another object's dict),
    or of an unknown version. The message says where (the key, which names the metric)
    and what is wrong. The ``Tracker`` or ``Window`` it was given to is left unchanged:
    everything is checked before anything is replaced.
    """


class TokenCountError(ValueError):
    """A tensor token count of ``throughput()``, read at the step's end, was negative or
    not finite; its call was dropped. ``calls``: the calls dropped per metric (in a
    sync, they count as rejected, so every rank raises together)."""

    def __init__(self, message: str, calls: dict[str, int]) -> None:
        super().__init__(message)
        self.calls = calls


__all__ = [
    "MalformedStateError",
    "ModifiedInputError",
    "RejectedInputError",
    "SyncTimeoutError",
    "TokenCountError",
]
