"""The log calls every tracker view shares (``LogMethods``), and the prefixed view.

``Tracker`` implements ``_log``, ``_log_shared`` and ``_log_by``; a ``PrefixedTracker``
forwards them with its prefix added to every name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from rlmetrics._engine.inputs import check_name
from rlmetrics.timing import log_elapsed, log_throughput, timer

if TYPE_CHECKING:
    from rlmetrics.tracker import Tracker


def _log_method(kind: str, doc: str) -> Callable[..., None]:
    """The log call of ``kind`` (``LogMethods.mean`` and the others), written once."""

    def log(
        self: LogMethods, name: str, value: Any, weight: Any = None, mask: Any = None,
        by: Any = None, labels: Any = None,
    ) -> None:  # fmt: skip
        if by is None and labels is None:
            self._log(name, kind, value, weight if mask is None else _alias(name, weight, mask))
        else:
            self._grouped([(name, kind)], value, weight, mask, by, labels)

    log.__name__ = kind
    log.__qualname__ = f"LogMethods.{kind}"
    log.__doc__ = doc
    return log


class LogMethods:
    """The logging calls shared by ``Tracker`` and its prefixed views.

    Every call takes ``weight=``: None (1 per element), a python number, or an array or
    tensor of the value's shape (a bool mask counts as 0/1). Its meaning is the kind's:
    a multiplier for ``mean``, ``std`` and ``sum``, a selector (weight > 0) for ``max``,
    ``min``, ``dist`` and ``last``; a bool mask means the same everywhere. An element
    with weight 0 contributes nothing, whatever its value. ``mask=`` is an alias of
    ``weight=``, kept for code written when ``sum``, ``max``, ``min`` and ``dist`` took
    a mask only (pass it by keyword; it is not keyword-only because a keyword-only
    default costs every call a dictionary lookup).

    Every call but ``last`` also takes ``by=``: a label per element (or per row, or one
    for the call): a python sequence or numpy array of strings or integers, or an integer
    tensor. Each label's elements are then logged under ``name/<label>``, exactly as if
    logged alone; ``labels=`` maps labels to the names used (``{0: "gsm8k"}``). Tensor
    labels are read at the fold (``compute()``), not at the call. See docs/groups.md and
    ``rlmetrics.groups``.
    """

    def _log(self, name: str, kind: str, value: Any, weight: Any) -> None:
        raise NotImplementedError

    mean = _log_method("mean", """Weighted mean: Σ value·weight / Σ weight.""")
    sum = _log_method(
        "sum", """Weighted sum Σ value·weight (a bool mask: the sum of the selected elements)."""
    )
    max = _log_method("max", """Largest element (of those with weight > 0).""")
    min = _log_method("min", """Smallest element (of those with weight > 0).""")
    std = _log_method(
        "std", """Weighted population standard deviation (ddof=0), exact when |mean| >> std."""
    )
    last = _log_method(
        "last",
        """A replicated scalar (lr, kl_coef): the latest on this rank; ranks must agree.
        A weight of 0 (or False) leaves the previous value in place.""",
    )
    dist = _log_method(
        "dist", """Every element with weight > 0: name/mean, /std, /min, /max, /pXX."""
    )
    quantile = _log_method(
        "quantile",
        """Every element with weight > 0 into a fixed-size sketch: the keys ``dist``
        reports, quantiles within a relative error (see docs/quantiles.md).""",
    )

    def log(
        self, name: str, value: Any, weight: Any = None, mask: Any = None, by: Any = None,
        labels: Any = None, *, kind: str,
    ) -> None:  # fmt: skip
        """Log into any registered kind (built-in or user-defined) by its name."""
        if by is None and labels is None:
            self._log(name, kind, value, weight if mask is None else _alias(name, weight, mask))
        else:
            self._grouped([(name, kind)], value, weight, mask, by, labels)

    def timer(self, name: str, **where: Any) -> AbstractContextManager[None]:
        """Time the block as this rank's entry into a stage: ``name`` reports the slowest
        rank's time in the step (a rank's entries summed), ``name/mean``, ``name/min``
        and ``name/slowest_rank``. ``where``: ``rank=``, ``world_size=`` (default: from
        the process group), ``group=``, ``device="cuda"`` (CUDA events, read at step
        end), ``clock=``. See ``rlmetrics.timing``.

        Example:
            >>> t = Tracker()
            >>> with t.timer("timing_s/gen", clock=iter([1.0, 3.5]).__next__):
            ...     pass
            >>> t.compute()["timing_s/gen"]
            2.5
        """
        return timer(self, name, **where)

    def elapsed(self, name: str, seconds: float, **where: Any) -> None:
        """Log ``seconds`` (measured elsewhere) as this rank's entry into a stage, as
        ``timer`` does (``where``: ``rank=``, ``world_size=``, ``group=``)."""
        log_elapsed(self, name, seconds, **where)

    def throughput(self, name: str, num_tokens: Any, seconds: float, **where: Any) -> None:
        """Log ``num_tokens`` (a number or a one-element tensor) this rank processed in
        ``seconds``: ``name`` = Σ tokens / (slowest rank's seconds × ranks), per rank as
        verl's ``perf/throughput``; ``name/total`` = Σ tokens / slowest rank's seconds."""
        log_throughput(self, name, num_tokens, seconds, **where)

    def log_shared(
        self,
        metrics: Sequence[tuple[str, str]],
        value: Any,
        weight: Any = None,
        mask: Any = None,
        by: Any = None,
        labels: Any = None,
    ) -> None:
        """Log one value (and weight) into several metrics, given as (name, kind) pairs,
        converting and checking the input once: the same as one ``log`` call per metric,
        in order, for less (with ``by=``, the labels are grouped once too), all landing
        in one step (a ``compute()`` in another thread comes before or after them all).

        Example:
            >>> t = Tracker()
            >>> t.log_shared([("len/mean", "mean"), ("len/max", "max")], [3, 5])
            >>> t.compute()
            {'len/max': 5.0, 'len/mean': 4.0}
        """
        metrics = list(metrics)
        if by is not None or labels is not None:
            if metrics:
                self._grouped(metrics, value, weight, mask, by, labels)
            return
        if mask is not None:
            weight = _alias(metrics[0][0] if metrics else "", weight, mask)
        self._log_shared(metrics, value, weight)

    def _log_shared(self, metrics: list[tuple[str, str]], value: Any, weight: Any) -> None:
        raise NotImplementedError

    def _holding(self) -> AbstractContextManager[Any]:
        """A context in which several log calls land in one step together (the
        tracker's lock; ``rl.log_updates`` applies its updates in it)."""
        raise NotImplementedError

    def _grouped(
        self, metrics: list[tuple[str, str]], value: Any, weight: Any, mask: Any, by: Any,
        labels: Any,
    ) -> None:  # fmt: skip
        """A call with ``by=`` (or, wrongly, ``labels=`` alone)."""
        name = metrics[0][0]
        if mask is not None:
            weight = _alias(name, weight, mask)
        if by is None:
            raise TypeError(f"metric {name!r}: labels= names the labels of by=; pass by= too")
        self._log_by(metrics, value, weight, by, labels)

    def _log_by(
        self, metrics: list[tuple[str, str]], value: Any, weight: Any, by: Any, labels: Any
    ) -> None:
        raise NotImplementedError

    def prefixed(self, prefix: str) -> PrefixedTracker:
        """A view that logs every name as ``prefix + name`` into the same tracker."""
        raise NotImplementedError


KIND_METHODS = ("mean", "sum", "max", "min", "std", "last", "dist", "quantile")
"""The kinds with a log method of their own (``LogMethods.mean`` and the others)."""


def _alias(name: str, weight: Any, mask: Any) -> Any:
    """``mask=`` is ``weight=`` by its older name; both at once is an error."""
    if weight is not None:
        raise TypeError(f"metric {name!r}: pass weight= or mask= (an alias), not both")
    return mask


RECORDS: dict[str, Callable[..., None]] = {}
"""The Tracker's own log method of each kind name (``Tracker.mean`` and the others, and
those ``Tracker._log`` made; filled by ``rlmetrics.tracker``)."""


def _prefixed_method(kind: str) -> Callable[..., None]:
    """A prefixed view's log call of ``kind``: the tracker's own log method, under the
    prefixed name (a call fewer than through ``_log``), unless the tracker's class
    overrides ``_log``."""
    through_log = _log_method(kind, "")

    def log(
        self: PrefixedTracker, name: str, value: Any, weight: Any = None, mask: Any = None,
        by: Any = None, labels: Any = None,
    ) -> None:  # fmt: skip
        if self._direct and mask is None and by is None and labels is None:
            RECORDS[kind](self.tracker, self.prefix + check_name(name), value, weight)
        else:
            through_log(self, name, value, weight, mask, by, labels)

    log.__name__ = kind
    log.__qualname__ = f"PrefixedTracker.{kind}"
    log.__doc__ = getattr(LogMethods, kind).__doc__
    return log


class PrefixedTracker(LogMethods):
    """A view of a Tracker that prepends a prefix to every name it logs."""

    def __init__(self, tracker: Tracker, prefix: str) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a string, got {type(prefix).__name__}")
        self.tracker = tracker
        self.prefix = prefix
        self._direct = tracker._logs_directly  # whether RECORDS holds its log methods

    def _log(self, name: str, kind: str, value: Any, weight: Any) -> None:
        self.tracker._log(self.prefix + check_name(name), kind, value, weight)

    def _log_shared(self, metrics: list[tuple[str, str]], value: Any, weight: Any) -> None:
        named = [(self.prefix + check_name(name), kind) for name, kind in metrics]
        self.tracker._log_shared(named, value, weight)

    def _holding(self) -> AbstractContextManager[Any]:
        return self.tracker._holding()

    def _log_by(
        self, metrics: list[tuple[str, str]], value: Any, weight: Any, by: Any, labels: Any
    ) -> None:
        named = [(self.prefix + check_name(name), kind) for name, kind in metrics]
        self.tracker._log_by(named, value, weight, by, labels)

    def prefixed(self, prefix: str) -> PrefixedTracker:
        return PrefixedTracker(self.tracker, self.prefix + prefix)


for _kind in KIND_METHODS:
    setattr(PrefixedTracker, _kind, _prefixed_method(_kind))

__all__ = ["KIND_METHODS", "RECORDS", "LogMethods", "PrefixedTracker"]
