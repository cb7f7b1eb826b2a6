"""Aggregation kinds and their registry."""

from __future__ import annotations

from rlmetrics.kinds.base import Accumulator, Kind, MetricState
from rlmetrics.kinds.dist import Dist
from rlmetrics.kinds.extrema import Max, Min
from rlmetrics.kinds.last import Last
from rlmetrics.kinds.mean import Mean
from rlmetrics.kinds.std import Std
from rlmetrics.kinds.sum import Sum

BUILTIN_KINDS: tuple[type[Kind], ...] = (Mean, Sum, Max, Min, Std, Last, Dist)
_registry: dict[str, Kind] = {cls.name: cls() for cls in BUILTIN_KINDS}


def register_kind(kind: Kind) -> Kind:
    """Register a user-defined kind under ``kind.name``, once.

    Raises:
        ValueError: the name is taken, or the kind is malformed.
        TypeError: ``kind`` is not a ``Kind`` instance.
    """
    if not isinstance(kind, Kind):
        raise TypeError(f"register_kind expects a Kind instance, got {type(kind).__name__}")
    if not isinstance(kind.name, str) or not kind.name:
        raise ValueError(f"kind {kind!r}: name must be a non-empty string")
    if kind.name in _registry:
        raise ValueError(f"kind {kind.name!r} is already registered ({_registry[kind.name]!r})")
    for field in ("num_sums", "num_maxes"):
        count = getattr(kind, field)
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"kind {kind.name!r}: {field} must be an int >= 0, got {count!r}")
    if type(kind).update is Kind.update:
        raise ValueError(f"kind {kind.name!r} must implement update()")
    if type(kind).result is Kind.result:
        raise ValueError(f"kind {kind.name!r} must implement result()")
    if kind.has_extra and type(kind).merge_extra is Kind.merge_extra:
        raise ValueError(f"kind {kind.name!r} has an extra payload but no merge_extra()")
    _registry[kind.name] = kind
    return kind


def unregister_kind(name: str) -> None:
    """Remove a user-defined kind (built-in kinds stay)."""
    if any(cls.name == name for cls in BUILTIN_KINDS):
        raise ValueError(f"kind {name!r} is built in and cannot be unregistered")
    _registry.pop(name, None)


def get_kind(name: str) -> Kind:
    """The registered kind called ``name``."""
    try:
        return _registry[name]
    except KeyError:
        raise ValueError(
            f"unknown kind {name!r}; registered kinds: {', '.join(sorted(_registry))}"
        ) from None


__all__ = [
    "BUILTIN_KINDS",
    "Accumulator",
    "Dist",
    "Kind",
    "Last",
    "Max",
    "Mean",
    "MetricState",
    "Min",
    "Std",
    "Sum",
    "get_kind",
    "register_kind",
    "unregister_kind",
]
