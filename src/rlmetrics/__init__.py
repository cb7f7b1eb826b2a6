"""rlmetrics: exact, cheap, partition-invariant training metrics.

Every logged number means the same thing however the batch was split across ranks,
mini-batches and micro-batches, at the cost of one small collective per step.
"""

from rlmetrics.errors import (
    MalformedStateError,
    ModifiedInputError,
    RejectedInputError,
    SyncTimeoutError,
    TokenCountError,
)
from rlmetrics.kinds import (
    ExtraKind,
    Kind,
    MetricState,
    get_kind,
    register_kind,
    unregister_kind,
)
from rlmetrics.state import TrackerState
from rlmetrics.tracker import Loggable, LogTarget, PrefixedTracker, Tracker
from rlmetrics.window import Window

__version__ = "0.1.0"

__all__ = [
    "ExtraKind",
    "Kind",
    "LogTarget",
    "Loggable",
    "MalformedStateError",
    "MetricState",
    "ModifiedInputError",
    "PrefixedTracker",
    "RejectedInputError",
    "SyncTimeoutError",
    "TokenCountError",
    "Tracker",
    "TrackerState",
    "Window",
    "get_kind",
    "register_kind",
    "unregister_kind",
]
