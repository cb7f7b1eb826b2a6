"""Aggregation kinds and their registry."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import numpy as np
import torch
from torch import Tensor

from rlmetrics.kinds.base import Kind, MetricState
from rlmetrics.kinds.batch import COLUMNS, Batch, DeviceBatch
from rlmetrics.kinds.dist import Dist
from rlmetrics.kinds.extra import ExtraKind
from rlmetrics.kinds.extrema import Max, Min
from rlmetrics.kinds.last import Last
from rlmetrics.kinds.mean import Mean
from rlmetrics.kinds.quantile import QuantileSketch
from rlmetrics.kinds.rank_time import family_kind
from rlmetrics.kinds.std import Std
from rlmetrics.kinds.sum import Sum

BUILTIN_KINDS: tuple[type[Kind], ...] = (Mean, Sum, Max, Min, Std, Last, Dist, QuantileSketch)
_registry: dict[str, Kind] = {cls.name: cls() for cls in BUILTIN_KINDS}
KINDS: Mapping[str, Kind] = MappingProxyType(_registry)
"""Every registered kind by name, read-only (``register_kind`` adds one; ``get_kind``
also makes a per-rank family's members)."""


def register_kind(kind: Kind, *, exist_ok: bool = False) -> Kind:
    """Register a user-defined kind under ``kind.name``, once per process.

    Every process that logs, merges or computes the kind's metrics must register it,
    under the same name, before it does so. The kind is checked here (its attributes,
    the methods it must implement, and one probe ``reduce`` on a small batch, on the host
    and through the device path), so a malformed kind fails now rather than at a step's
    sync.

    Args:
        kind: the kind instance.
        exist_ok: return the registered kind instead of raising when an equal kind
            (``==``, by default the same object) is already registered under the name.

    Returns:
        The registered kind.

    Raises:
        ValueError: the name is taken by a different kind, or the kind is malformed.
        TypeError: ``kind`` is not a ``Kind`` instance.
    """
    if not isinstance(kind, Kind):
        raise TypeError(f"register_kind expects a Kind instance, got {type(kind).__name__}")
    if not isinstance(kind.name, str) or not kind.name:
        raise ValueError(f"kind {kind!r}: name must be a non-empty string, got {kind.name!r}")
    existing = _registry.get(kind.name)
    if existing is not None:
        if exist_ok and existing == kind:
            return existing
        if any(cls.name == kind.name for cls in BUILTIN_KINDS):
            hint = "built-in names are reserved"
        else:
            hint = "unregister_kind() it first; exist_ok=True accepts only an equal kind"
        raise ValueError(
            f"kind {kind.name!r} is already registered as {existing!r}; cannot register "
            f"{kind!r} under the same name ({hint})"
        )
    check_kind(kind)
    _registry[kind.name] = kind
    return kind


def check_kind(kind: Kind) -> None:
    """Check a kind against the protocol: slot counts, required methods, one probe.

    The probe runs ``reduce`` on a three-metric batch (two elements, one of weight 0;
    no element; one element), on the host and through the device path on the CPU, and
    checks the shapes and dtypes it returns. ``register_kind`` calls this.

    Raises:
        ValueError: naming the kind and what is wrong.
    """
    label = f"kind {kind.name!r} ({type(kind).__name__})"
    for attr in ("num_sums", "num_maxes"):
        count = getattr(kind, attr)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{label}: {attr} must be an int >= 0, got {count!r}")
    for attr in ("has_extra", "keeps_latest"):
        if not isinstance(getattr(kind, attr), bool):
            raise ValueError(f"{label}: {attr} must be a bool, got {getattr(kind, attr)!r}")
    for attr in ("sum_columns", "max_columns"):
        unknown = [c for c in getattr(kind, attr) if c not in COLUMNS]
        if unknown:
            raise ValueError(
                f"{label}: {attr} names unknown columns {unknown}; columns: {', '.join(COLUMNS)}"
            )
    # the default reduce fills declared columns; a kind with no slot must have an extra
    declared = kind.sum_columns or kind.max_columns or kind.has_extra
    required = [] if kind.slots_declared and declared else ["reduce"]
    if not (_overrides(kind, "result") or _overrides(kind, "result_columns")):
        required.append("result")  # or result_columns
    if kind.has_extra:
        if not isinstance(kind, ExtraKind):
            raise ValueError(
                f"{label}: has_extra=True takes the extra methods of "
                "rlmetrics.kinds.ExtraKind: subclass it instead of Kind"
            )
        required += ["reduce_extra", "merge_extra"]
        if _overrides(kind, "extra_vector"):
            required += ["vector_length", "extra_from_vector"]
    missing = [f"{method}()" for method in required if not _overrides(kind, method)]
    if missing:
        why = " (has_extra=True needs reduce_extra and merge_extra)" if kind.has_extra else ""
        raise ValueError(f"{label} must implement {', '.join(missing)}{why}")
    values, weights = np.array([1.0, 0.0, 3.0]), np.array([1.0, 0.0, 1.0])
    segments, lengths = np.array([0, 0, 2]), [2, 0, 1]
    for batch in (
        Batch(values, weights, segments, lengths, [2, 1]),
        DeviceBatch(
            torch.from_numpy(values),
            torch.from_numpy(weights),
            torch.from_numpy(segments),
            lengths,
            [2, 1],
        ),
    ):
        _probe_reduce(kind, label, batch)


def _overrides(kind: Kind, method: str) -> bool:
    return getattr(type(kind), method) is not getattr(ExtraKind, method)


def _probe_reduce(kind: Kind, label: str, batch: Batch) -> None:
    where = "on the host" if batch.on_host else "through the device path"
    try:
        out = kind.reduce(batch)
    except Exception as error:
        raise ValueError(f"{label}: reduce() failed on a probe batch {where}: {error}") from error
    array = np.ndarray if batch.on_host else Tensor
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(a, array) for a in out)):
        raise ValueError(
            f"{label}: reduce() must return a (sums, maxes) pair of "
            f"{array.__name__}s {where}, got {out!r}"
        )
    for slots, block, count in (("sums", out[0], kind.num_sums), ("maxes", out[1], kind.num_maxes)):
        if str(block.dtype) not in ("float64", "torch.float64") or tuple(block.shape) != (3, count):
            raise ValueError(
                f"{label}: reduce() returned {slots} of shape {tuple(block.shape)} and dtype "
                f"{block.dtype} for a probe batch of 3 metrics {where}; expected shape "
                f"(3, {count}) float64, as num_{slots}={count} declares"
            )


def unregister_kind(name: str) -> None:
    """Remove a user-defined kind (built-in kinds stay)."""
    if any(cls.name == name for cls in BUILTIN_KINDS):
        raise ValueError(f"kind {name!r} is built in and cannot be unregistered")
    _registry.pop(name, None)


def kind_names() -> tuple[str, ...]:
    """The names of the kinds registered in this process (built in and user-defined)."""
    return tuple(_registry)


def get_kind(name: str) -> Kind:
    """The registered kind called ``name`` (a per-rank family's member, such as
    ``rank_time@4``, is made and registered on first use: ``kinds.rank_time``)."""
    try:
        return _registry[name]
    except KeyError:
        member = family_kind(name)
        if member is not None:
            return register_kind(member, exist_ok=True)
        raise ValueError(
            f"unknown kind {name!r}; registered kinds: {', '.join(sorted(_registry))}"
        ) from None


__all__ = [
    "BUILTIN_KINDS",
    "Batch",
    "DeviceBatch",
    "Dist",
    "ExtraKind",
    "Kind",
    "Last",
    "Max",
    "Mean",
    "MetricState",
    "Min",
    "QuantileSketch",
    "Std",
    "Sum",
    "check_kind",
    "get_kind",
    "kind_names",
    "register_kind",
    "unregister_kind",
]
