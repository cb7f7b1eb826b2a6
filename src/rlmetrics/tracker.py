"""The Tracker: named metrics, each with one aggregation kind, logged without host syncs."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from operator import attrgetter, methodcaller
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from rlmetrics._engine.fold import fold, joined_errors
from rlmetrics._engine.inputs import as_number, check_name
from rlmetrics._engine.packing import ReducedStep, local_reduce
from rlmetrics._engine.plan import StepPlan
from rlmetrics._engine.record import (
    NUMBER_DTYPES,
    TENSOR_WEIGHTS,
    CheckedWeight,
    MetricRecords,
    NumberRecords,
    Prepared,
    prepare,
    record_number,
    record_prepared,
    record_tensor,
)
from rlmetrics._engine.sync import SyncedParts, as_timeout, should_sync, sync_reduce
from rlmetrics._engine.table import UNMERGED, StateTable
from rlmetrics._groups import Groups, LabelledPart, check_kinds
from rlmetrics.errors import RejectedInputError
from rlmetrics.kinds import KINDS, Dist, Kind, QuantileSketch, get_kind
from rlmetrics.kinds.base import REJECTED_SLOT, carries_extra
from rlmetrics.kinds.dist import DEFAULT_QUANTILES
from rlmetrics.state import TrackerState, check_metric, checked_load, merged_extra
from rlmetrics.timing import DeviceTimers, log_elapsed, log_throughput, timer

EMPTY_POLICIES = ("omit", "nan")
NONFINITE_POLICIES = ("propagate", "skip", "error")

_Method = TypeVar("_Method", bound=Callable[..., Any])
_Result = TypeVar("_Result")
_get_values = attrgetter("values")


def _locked(method: _Method) -> _Method:
    """A Tracker method that holds the tracker's lock while it runs (see "Threads" in
    ``Tracker``); the log calls take the lock inline (docs/architecture.md, "Performance")."""

    @functools.wraps(method)
    def locked(self: Tracker, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]


def _alias(name: str, weight: Any, mask: Any) -> Any:
    """``mask=`` is ``weight=`` under the name that reads better for a selection; both at
    once is an error."""
    if weight is not None:
        raise TypeError(f"metric {name!r}: pass weight= or mask= (an alias), not both")
    return mask


Loggable = float | Tensor | np.ndarray | np.generic | Sequence[Any]
"""What a log call takes as a value or a weight: a python number (an int or a bool is
a float to a type checker), a tensor, a numpy array or scalar, or a sequence of numbers
(nested for more dimensions)."""

Labels = Tensor | np.ndarray | Sequence[Any] | str | int
"""What ``by=`` takes: a label per element, per row, or one for the call."""


class LogTarget:
    """Something you can log into: a ``Tracker``, or a prefixed view of one.

    Annotate a function that logs with it, and pass it either. Its log calls are the
    same on both: each goes to ``_log``, the one path. A Tracker records the call; a
    prefixed view adds its prefix and hands the call to its tracker.

    Every call takes ``weight=``: None (1 per element), a python number, or an array or
    tensor of the value's shape (a bool mask counts as 0/1). Its meaning is the kind's.
    It is a multiplier for ``mean``, ``std`` and ``sum``, and a selector (weight > 0)
    for ``max``, ``min``, ``dist``, ``quantile`` and ``last``. A bool mask means the same
    everywhere. An element with weight 0 contributes nothing, whatever its value.
    ``mask=`` is ``weight=`` under the name that reads better for a selection (by
    keyword; not both).

    ``mask``, ``by`` and ``labels`` are meant by keyword, as the docs pass them. They
    are not keyword-only: CPython 3.11 does not specialize a call to a function with
    keyword-only parameters, and every log call would pay for that (RESULTS.md,
    ``compare:log_bench-issue43-closing``).

    Every call but ``last`` also takes ``by=``: a label per element, per row, or one for
    the call. Labels are strings or integers, in a python sequence or numpy array, or an
    integer tensor. Each label's elements are then logged under ``name/<label>``, exactly
    as if logged alone. ``labels=`` maps labels to the names used (``{0: "gsm8k"}``).
    Tensor labels are read at the fold (``compute()``), not at the call. See
    docs/groups.md.
    """

    device_timers: DeviceTimers
    """The tracker's device timers and tensor token counts not read yet (``timing``)."""

    def _log(self, name: str, kind: str, value: Any, weight: Any, by: Any, labels: Any) -> None:
        """One log call, as the kind methods pass it (``mask=`` is its ``weight``)."""
        raise NotImplementedError

    def mean(
        self,
        name: str,
        value: Loggable,
        weight: Loggable | None = None,
        mask: Loggable | None = None,
        by: Labels | None = None,
        labels: Mapping[Any, str] | None = None,
    ) -> None:
        """Weighted mean: Σ value·weight / Σ weight.

        Args:
            name: the metric's name, e.g. ``"actor/pg_loss"``.
            value: a python number, a sequence, a numpy array or a tensor, any
                shape (device tensors are read at ``compute()``).
            weight: a multiplier per element: None (1 each), a number, or an array or
                tensor of ``value``'s shape (a bool mask counts as 0/1). A token
                mean takes the response mask here.
            mask: ``weight`` under the name that reads better where it selects (a bool
                mask); not both.
            by: a label per element, per row or one for the call: each label's
                elements are reported as ``name/<label>`` (docs/groups.md).
            labels: the name used for each label of ``by``, e.g. ``{0: "gsm8k"}``.
        """
        self._log(
            name, "mean", value, weight if mask is None else _alias(name, weight, mask), by, labels
        )

    def sum(
        self,
        name: str,
        value: Loggable,
        weight: Loggable | None = None,
        mask: Loggable | None = None,
        by: Labels | None = None,
        labels: Mapping[Any, str] | None = None,
    ) -> None:
        """Weighted sum Σ value·weight (a bool mask: the sum of the selected elements).

        Args:
            name: the metric's name, e.g. ``"actor/pg_loss"``.
            value: a python number, a sequence, a numpy array or a tensor, any
                shape (device tensors are read at ``compute()``).
            weight: a multiplier per element: None (1 each), a number, or an array or
                tensor of ``value``'s shape (a bool mask counts as 0/1).
            mask: ``weight`` under the name that reads better where it selects (a bool
                mask); not both.
            by: a label per element, per row or one for the call: each label's
                elements are reported as ``name/<label>`` (docs/groups.md).
            labels: the name used for each label of ``by``, e.g. ``{0: "gsm8k"}``.
        """
        self._log(
            name, "sum", value, weight if mask is None else _alias(name, weight, mask), by, labels
        )

    def max(
        self,
        name: str,
        value: Loggable,
        weight: Loggable | None = None,
        mask: Loggable | None = None,
        by: Labels | None = None,
        labels: Mapping[Any, str] | None = None,
    ) -> None:
        """Largest element (of those with weight > 0).

        Args:
            name: the metric's name, e.g. ``"actor/pg_loss"``.
            value: a python number, a sequence, a numpy array or a tensor, any
                shape (device tensors are read at ``compute()``).
            weight: selects the elements with weight > 0: None (all), a number, or an
                array or tensor of ``value``'s shape (a bool mask).
            mask: ``weight`` under the name that reads better where it selects (a bool
                mask); not both.
            by: a label per element, per row or one for the call: each label's
                elements are reported as ``name/<label>`` (docs/groups.md).
            labels: the name used for each label of ``by``, e.g. ``{0: "gsm8k"}``.
        """
        self._log(
            name, "max", value, weight if mask is None else _alias(name, weight, mask), by, labels
        )

    def min(
        self,
        name: str,
        value: Loggable,
        weight: Loggable | None = None,
        mask: Loggable | None = None,
        by: Labels | None = None,
        labels: Mapping[Any, str] | None = None,
    ) -> None:
        """Smallest element (of those with weight > 0).

        Args:
            name: the metric's name, e.g. ``"actor/pg_loss"``.
            value: a python number, a sequence, a numpy array or a tensor, any
                shape (device tensors are read at ``compute()``).
            weight: selects the elements with weight > 0: None (all), a number, or an
                array or tensor of ``value``'s shape (a bool mask).
            mask: ``weight`` under the name that reads better where it selects (a bool
                mask); not both.
            by: a label per element, per row or one for the call: each label's
                elements are reported as ``name/<label>`` (docs/groups.md).
            labels: the name used for each label of ``by``, e.g. ``{0: "gsm8k"}``.
        """
        self._log(
            name, "min", value, weight if mask is None else _alias(name, weight, mask), by, labels
        )

    def std(
        self,
        name: str,
        value: Loggable,
        weight: Loggable | None = None,
        mask: Loggable | None = None,
        by: Labels | None = None,
        labels: Mapping[Any, str] | None = None,
    ) -> None:
        """Weighted population standard deviation (ddof=0), exact when |mean| >> std.

        Args:
            name: the metric's name, e.g. ``"actor/pg_loss"``.
            value: a python number, a sequence, a numpy array or a tensor, any
                shape (device tensors are read at ``compute()``).
            weight: a multiplier per element (a frequency): None (1 each), a number, or
                an array or tensor of ``value``'s shape (a bool mask counts as 0/1).
            mask: ``weight`` under the name that reads better where it selects (a bool
                mask); not both.
            by: a label per element, per row or one for the call: each label's
                elements are reported as ``name/<label>`` (docs/groups.md).
            labels: the name used for each label of ``by``, e.g. ``{0: "gsm8k"}``.
        """
        self._log(
            name, "std", value, weight if mask is None else _alias(name, weight, mask), by, labels
        )

    def last(
        self,
        name: str,
        value: Loggable,
        weight: Loggable | None = None,
        mask: Loggable | None = None,
        by: Labels | None = None,
        labels: Mapping[Any, str] | None = None,
    ) -> None:
        """A replicated scalar (lr, kl_coef): the latest on this rank; ranks must agree.
        A weight of 0 (or False) leaves the previous value in place.

        Args:
            name: the metric's name, e.g. ``"actor/pg_loss"``.
            value: one number: a python number or a one-element array or tensor.
            weight: 0 (or False) leaves the previous value in place; None or > 0 takes
                ``value``.
            mask: ``weight`` under the name that reads better where it selects (a bool
                mask); not both.
            by, labels: not taken by ``last`` (a replicated value has no groups).
        """
        self._log(
            name, "last", value, weight if mask is None else _alias(name, weight, mask), by, labels
        )

    def dist(
        self,
        name: str,
        value: Loggable,
        weight: Loggable | None = None,
        mask: Loggable | None = None,
        by: Labels | None = None,
        labels: Mapping[Any, str] | None = None,
    ) -> None:
        """Every element with weight > 0: name/mean, /std, /min, /max, /pXX.

        Args:
            name: the metric's name, e.g. ``"actor/pg_loss"``.
            value: a python number, a sequence, a numpy array or a tensor, any
                shape (device tensors are read at ``compute()``).
            weight: selects the elements with weight > 0: None (all), a number, or an
                array or tensor of ``value``'s shape (a bool mask).
            mask: ``weight`` under the name that reads better where it selects (a bool
                mask); not both.
            by: a label per element, per row or one for the call: each label's
                elements are reported as ``name/<label>`` (docs/groups.md).
            labels: the name used for each label of ``by``, e.g. ``{0: "gsm8k"}``.
        """
        self._log(
            name, "dist", value, weight if mask is None else _alias(name, weight, mask), by, labels
        )

    def quantile(
        self,
        name: str,
        value: Loggable,
        weight: Loggable | None = None,
        mask: Loggable | None = None,
        by: Labels | None = None,
        labels: Mapping[Any, str] | None = None,
    ) -> None:
        """Every element with weight > 0 into a fixed-size sketch: the keys ``dist``
        reports, quantiles within a relative error (see docs/quantiles.md).

        Args:
            name: the metric's name, e.g. ``"actor/pg_loss"``.
            value: a python number, a sequence, a numpy array or a tensor, any
                shape (device tensors are read at ``compute()``).
            weight: selects the elements with weight > 0: None (all), a number, or an
                array or tensor of ``value``'s shape (a bool mask).
            mask: ``weight`` under the name that reads better where it selects (a bool
                mask); not both.
            by: a label per element, per row or one for the call: each label's
                elements are reported as ``name/<label>`` (docs/groups.md).
            labels: the name used for each label of ``by``, e.g. ``{0: "gsm8k"}``.
        """
        self._log(
            name,
            "quantile",
            value,
            weight if mask is None else _alias(name, weight, mask),
            by,
            labels,
        )

    def log(
        self,
        name: str,
        value: Loggable,
        weight: Loggable | None = None,
        *,
        mask: Loggable | None = None,
        by: Labels | None = None,
        labels: Mapping[Any, str] | None = None,
        kind: str,
    ) -> None:
        """Log into any registered kind (built-in or user-defined) by its name.

        Args:
            name: the metric's name, e.g. ``"actor/pg_loss"``.
            value: a python number, a sequence, a numpy array or a tensor, any
                shape (device tensors are read at ``compute()``).
            weight: as the kind defines it (a multiplier or a selector; see
                ``LogTarget``): None (1 each), a number, or an array or tensor of
                ``value``'s shape.
            mask: ``weight`` under the name that reads better where it selects (a bool
                mask); not both.
            by: a label per element, per row or one for the call: each label's
                elements are reported as ``name/<label>`` (docs/groups.md).
            labels: the name used for each label of ``by``, e.g. ``{0: "gsm8k"}``.
            kind: the registered kind's name, e.g. ``"histogram"``.
        """
        self._log(
            name, kind, value, weight if mask is None else _alias(name, weight, mask), by, labels
        )

    def timer(self, name: str, **where: Any) -> AbstractContextManager[None]:
        """Time the block as this rank's entry into a stage: ``name`` reports the slowest
        rank's time in the step (a rank's entries summed), ``name/mean``, ``name/min``
        and ``name/slowest_rank``. ``where``: ``rank=``, ``world_size=`` (default: from
        the process group), ``group=``, ``device="cuda"`` (CUDA events, read at step
        end), ``clock=``. See ``rlmetrics.timing``.

        Examples:
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

    def throughput(
        self, name: str, num_tokens: float | Tensor, seconds: float, **where: Any
    ) -> None:
        """Log ``num_tokens`` (a number or a one-element tensor) this rank processed in
        ``seconds``: ``name`` = Σ tokens / (slowest rank's seconds × ranks), per rank as
        verl's ``perf/throughput``; ``name/total`` = Σ tokens / slowest rank's seconds."""
        log_throughput(self, name, num_tokens, seconds, **where)

    def log_shared(
        self,
        metrics: Sequence[tuple[str, str]],
        value: Loggable,
        weight: Loggable | None = None,
        *,
        mask: Loggable | None = None,
        by: Labels | None = None,
        labels: Mapping[Any, str] | None = None,
    ) -> None:
        """Log one value (and weight) into several metrics, given as (name, kind) pairs,
        converting and checking the input once: the same as one ``log`` call per metric,
        in order, for less (with ``by=``, the labels are grouped once too), all landing
        in one step (a ``compute()`` in another thread comes before or after them all).

        Examples:
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
        self,
        metrics: list[tuple[str, str]],
        value: Any,
        weight: Any,
        mask: Any,
        by: Any,
        labels: Any,
    ) -> None:
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


class PrefixedTracker(LogTarget):
    """A view of a Tracker that prepends a prefix to every name it logs."""

    def __init__(self, tracker: Tracker, prefix: str) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a string, got {type(prefix).__name__}")
        self.tracker = tracker
        self.prefix = prefix
        self.device_timers = tracker.device_timers

    def _log(self, name: str, kind: str, value: Any, weight: Any, by: Any, labels: Any) -> None:
        self.tracker._log(self.prefix + check_name(name), kind, value, weight, by, labels)

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


class Tracker(LogTarget):
    """Named metrics of one step, each reduced by its kind, merged exactly.

    A log call records its value and weight (python numbers, arrays, tensors as they
    are: no arithmetic, no torch operation, no host sync); once per step, each kind
    reduces all its records in one vectorised pass per device (``rlmetrics._engine.fold``).
    ``compute()`` ends the step: it folds, packs every state, syncs over a process group
    when one is initialised (one collective for all scalar kinds in a steady-state
    step), transfers once and returns ``dict[str, float]``.

    Args:
        empty: "omit" leaves empty metrics out of ``compute()``; "nan" reports NaN.
        nonfinite: "propagate" (the arithmetic decides), "skip" (drop non-finite
            elements, masked or not, report ``<name>/nonfinite_count``) or "error"
            (raise; for tensors at ``compute()``, the offending call dropped, since an
            eager check would need a host sync).
        quantiles: the quantiles ``dist`` metrics report.

    Three class attributes tune how records are kept and reduced:
    ``reduce_host_data_with_numpy``, ``copy_cpu_tensors`` and ``record_limit`` (each
    documented where it is defined; set them on the class or on an instance).

    Threads: a tracker may be shared by threads. Each log call holds the tracker's lock
    (uncontended, a fraction of the call's cost; ``log_shared`` and
    ``rl.log_updates`` hold it over all their metrics), and ``compute()``, ``state()``,
    ``take_state()``, ``merge()`` and ``reset()`` hold it throughout: every call lands
    whole in one step, and a call made while ``compute()`` runs waits and lands in the
    next step. To end a step without a sync, use ``take_state()``, not ``state()`` then
    ``reset()`` (which drops the calls made between the two). Several threads then
    contend for one lock; a tracker per thread, merged at step end (``merge``, which
    takes the other tracker's state before its own lock, so merges never deadlock),
    avoids that.

    Examples:
        >>> t = Tracker()
        >>> actor = t.prefixed("actor/")
        >>> for loss, tokens in ((2.0, 1.0), (1.0, 3.0)):
        ...     actor.mean("pg_loss", loss, weight=tokens)
        >>> t.compute()
        {'actor/pg_loss': 1.25}
    """

    def __init__(
        self,
        *,
        empty: str = "omit",
        nonfinite: str = "propagate",
        quantiles: tuple[float, ...] = DEFAULT_QUANTILES,
    ) -> None:
        if empty not in EMPTY_POLICIES:
            raise ValueError(f"Tracker(empty=...) must be one of {EMPTY_POLICIES}, got {empty!r}")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"Tracker(nonfinite=...) must be one of {NONFINITE_POLICIES}, got {nonfinite!r}"
            )
        self.empty = empty
        self.nonfinite = nonfinite
        self._own_kinds: dict[str, Kind] = {
            "dist": Dist(quantiles),
            "quantile": QuantileSketch(quantiles=quantiles),
        }
        self._metric_records: dict[str, MetricRecords] = {}  # this step's metrics
        # Every name's MetricRecords, kept across steps and cleared on reuse. No step
        # allocates per name, and the caches recognise a step's metrics as the last
        # one's (see rlmetrics._engine.plan).
        self._pool: dict[str, MetricRecords] = {}
        self._table = StateTable()  # every pooled metric's folded state, a row each
        self._plan = StepPlan()  # every cache kept between steps
        self._lock = threading.RLock()  # see "Threads" above
        self._numbers = NumberRecords()  # python-number calls since the last fold
        self._fold_errors: list[ValueError] = []  # of early folds, raised by the next
        self._checked_weight = CheckedWeight()  # the last tensor weight logged
        self._recorded = 0  # elements and calls recorded since the last fold
        # device timers and tensor token counts not read yet (``rlmetrics.timing``)
        self.device_timers = DeviceTimers(self._logged_kind, self._holding)
        self._groups = Groups()  # calls with by= waiting for the fold
        # read by every log call, so kept on the instance (docs/architecture.md, "Performance")
        self.record_limit = type(self).record_limit
        self.reduce_host_data_with_numpy = type(self).reduce_host_data_with_numpy
        self.copy_cpu_tensors = type(self).copy_cpu_tensors

    reduce_host_data_with_numpy: bool = True
    """True (the default) reduces CPU tensors, numpy arrays and lists with numpy on the
    host, which costs less than torch's dispatch for the small arrays metrics see;
    device tensors always take the device path. False sends host data down the device
    path too (tests use it to run that path on the CPU)."""

    copy_cpu_tensors: bool = True
    """True (the default) records a CPU tensor as a copy of its values at the log call,
    as a numpy array is: torch counts no change made through memory it shares with numpy
    (``torch.from_numpy``, ``.numpy()``) or through ``.data``, so a later change could
    reach a record unseen. Device tensors are recorded by reference (a copy would cost a
    device operation per call), their version counter checked at the fold
    (docs/concepts.md). False records CPU tensors by reference too, with the same checks:
    a caller that never changes a logged CPU tensor before the step's end saves a copy
    per tensor; tests use it to run the device tensors' checks on the CPU."""

    record_limit: int = 1 << 22
    """The elements and calls (a python number counts once, an array or tensor its size
    plus one) a tracker records before it folds them into its states mid-step, which
    bounds the memory its records keep alive (the logged tensors); the fold is the
    step-end one, without a host sync, and its errors (a tensor changed in place) are
    raised by the step's end, not by the log call that passed the bound."""

    # -- logging ------------------------------------------------------------------
    def kind(self, kind_name: str) -> Kind:
        """The kind object this tracker uses for ``kind_name``: its own ``dist`` (with
        its quantiles), else the registered one (looked up each time, so a kind
        registered again later is seen)."""
        return self._own_kinds.get(kind_name) or KINDS.get(kind_name) or get_kind(kind_name)

    def _log(self, name: str, kind: str, value: Any, weight: Any, by: Any, labels: Any) -> None:
        """Every log call of this tracker and its views (the kind methods, ``log``): under
        the tracker's lock, the metric found (or made: a failed first call leaves none),
        then the value recorded; a plain float and a plain tensor by the shortest way.
        A call with ``by=`` goes to ``rlmetrics._groups``, which hands back one call per
        label (``_log_shared``), at once or at the fold.

        A subclass that overrides ``_log`` sees every log call, as made
        (``rlmetrics.cli.audit.RecordingTracker``)."""
        if by is not None or labels is not None:
            if by is None:
                raise TypeError(f"metric {name!r}: labels= names the labels of by=; pass by= too")
            self._log_by([(name, kind)], value, weight, by, labels)
            return
        lock = self._lock
        lock.acquire()
        try:
            try:
                records = self._metric_records.get(name)
            except TypeError:  # an unhashable name
                check_name(name)
                raise
            if records is None or records.kind_name != kind:
                # the step's first call, or a kind conflict, which raises
                records = self._add_metric(name, self.kind(kind))
                new = True
            else:
                new = False
            try:
                value_type = type(value)
                if (
                    value_type is float
                    and weight is None
                    and records.in_number_records
                    and (value - value == 0.0 or self.nonfinite == "propagate")  # finite
                ):  # record_number's work for a plain float, written out
                    numbers = self._numbers
                    numbers.values.append(value)
                    numbers.rows.append(records.row)
                    records.accepted_a_call = True
                    self._recorded += 1
                elif (
                    value_type is Tensor
                    and weight is None
                    and records.in_number_records
                    and not value.dim()
                    and self.copy_cpu_tensors
                    and self.reduce_host_data_with_numpy
                    and value.is_cpu
                    and value.dtype in NUMBER_DTYPES
                    and (
                        (number := value.tolist()) - number == 0.0 or self.nonfinite == "propagate"
                    )
                ):  # a 0-d CPU tensor copied is its number (record_tensor's record of it), and
                    # a finite one is recorded as the float above (the same lines: a call
                    # would cost the float's a tenth of its time)
                    numbers = self._numbers
                    numbers.values.append(number)
                    numbers.rows.append(records.row)
                    records.accepted_a_call = True
                    self._recorded += 1
                elif value_type is Tensor and (weight is None or type(weight) in TENSOR_WEIGHTS):
                    self._recorded += 1 + record_tensor(
                        records,
                        name,
                        value,
                        weight,
                        self.reduce_host_data_with_numpy,
                        self.copy_cpu_tensors,
                        self._checked_weight,
                        self.nonfinite,
                    )
                else:
                    self._log_value(records, name, value, weight)
            except BaseException:
                if new:
                    del self._metric_records[name]  # a failed first call leaves no empty metric
                raise
            if self._recorded > self.record_limit:
                self._fold_early()
        finally:
            lock.release()

    def _log_value(self, records: MetricRecords, name: str, value: Any, weight: Any) -> None:
        """Record a value ``_log`` does not record itself: python numbers, prepared values
        (``log_shared``), tensors, arrays and the rest."""
        value_type = type(value)
        if (value_type is float or value_type is int) and (
            weight is None or type(weight) is float or type(weight) is int
        ):
            try:
                number = float(value)
                weight = 1.0 if weight is None else float(weight)
            except OverflowError:  # an int beyond float64's range: as_number names it
                as_number(name, value)
                as_number(name, weight, "weight")
                raise
            record_number(records, name, number, weight, self.nonfinite, self._numbers)
            self._recorded += 1
            return
        if value_type is not Prepared:
            value = self._prepare(name, value, weight, self._checked_weight)
        self._recorded += 1 + record_prepared(records, name, value, self.nonfinite, self._numbers)

    def _log_shared(self, metrics: list[tuple[str, str]], value: Any, weight: Any) -> None:
        if metrics:
            prepared = self._prepare(metrics[0][0], value, weight)
            with self._lock:  # the call's metrics land in one step
                for name, kind_name in metrics:
                    self._log(name, kind_name, prepared, None, None, None)

    def _prepare(
        self, name: str, value: Any, weight: Any, checked: CheckedWeight | None = None
    ) -> Prepared:
        """``prepare`` under this tracker's switches (the numpy host path, the CPU copy)."""
        numpy_path, copy = self.reduce_host_data_with_numpy, self.copy_cpu_tensors
        return prepare(
            name, value, weight, reduce_host_data_with_numpy=numpy_path, copy=copy, checked=checked
        )

    def _holding(self) -> AbstractContextManager[Any]:
        """The lock that makes several log calls land in one step together."""
        return self._lock

    def _log_by(
        self, metrics: list[tuple[str, str]], value: Any, weight: Any, by: Any, labels: Any
    ) -> None:
        with self._lock:
            parts, deferred = self._groups.log(
                metrics, value, weight, by, labels, self.kind, self._prepare, self.copy_cpu_tensors
            )
            self._log_parts(parts)
            self._recorded += deferred  # after the parts, which may fold
            if self._recorded > self.record_limit:
                self._fold_early()

    def _log_parts(self, parts: list[LabelledPart]) -> None:
        """Log a grouped call's parts, one ``_log_shared`` call per label, after checking
        that none names a metric of another kind (a call that fails logs nothing)."""
        check_kinds(self._metric_records, parts)
        for metrics, value, weight in parts:
            self._log_shared(metrics, value, weight)

    def _fold(self, wait: bool = True) -> None:
        """Reduce every record into the states (see ``rlmetrics._engine.fold``), after logging
        the device timers (all, waiting for them; the finished ones without ``wait``)
        and splitting the calls with ``by=`` that wait for it (``rlmetrics._groups``).
        Raises the fold's errors, those of the step's early folds included."""
        errors, self._fold_errors = self._fold_errors, []
        if self.device_timers.pending:
            try:
                self.device_timers.read(wait)
            except ValueError as error:  # a bad tensor token count: its call dropped
                errors.append(error)
        try:
            self._checked_weight.clear()  # the records no longer keep the weight alive
            if self._recorded and not self._groups.resolving:
                # every call recorded one flat number: no metric holds records of its own
                flat_only = self._recorded == len(self._numbers.values)
                try:
                    if self._groups.pending:
                        self._groups.resolve(self._log_parts)
                finally:
                    self._recorded = 0
                    metrics = list(self._metric_records.values())
                    fold(
                        metrics,
                        self._numbers,
                        self._table,
                        self._plan,
                        self.nonfinite,
                        flat_only=flat_only,
                    )
        except ValueError as error:  # calls dropped (ModifiedInputError, by= calls)
            errors.append(error)
        if errors:
            raise errors[0] if len(errors) == 1 else joined_errors(errors)

    def _fold_early(self) -> None:
        """The fold past ``record_limit``, inside a log call. Its errors are about
        earlier calls, so they wait for the step's next fold (``compute()``, ``state()``,
        ``merge()``), which raises them."""
        try:
            self._fold(wait=False)
        except ValueError as error:
            self._fold_errors.append(error)

    def _add_metric(self, name: str, kind: Kind) -> MetricRecords:
        """A new metric of this step: its pooled MetricRecords, cleared, or new ones.

        Raises:
            ValueError: ``name`` is logged as another kind this step.
        """
        records = self._metric_records.get(name)
        if records is not None:
            raise ValueError(
                f"metric {name!r} is already logged as kind {records.kind.name!r}; "
                f"cannot log it as kind {kind.name!r}"
            )
        records = self._pool.get(name)
        if records is not None and records.kind is kind:
            records.clear()
        else:
            check_name(name)
            records = self._pool[name] = MetricRecords(
                kind, self._table, self._table.add_row(kind), name
            )
        self._metric_records[name] = records
        return records

    def _logged_kind(self, name: str) -> str | None:
        """The kind name ``name`` is logged as this step, or None."""
        records = self._metric_records.get(name)
        return None if records is None else records.kind.name

    def prefixed(self, prefix: str) -> PrefixedTracker:
        return PrefixedTracker(self, prefix)

    # -- state --------------------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        return name in self._metric_records

    def __len__(self) -> int:
        return len(self._metric_records)

    def __iter__(self) -> Iterator[str]:
        with self._lock:  # a snapshot: another thread may log a new name meanwhile
            return iter(list(self._metric_records))

    @_locked
    def schema(self) -> dict[str, str]:
        """The names logged since the last reset, with their kind names."""
        return {name: records.kind.name for name, records in self._metric_records.items()}

    def _synced_step(self, group: Any, timeout: float | timedelta | None) -> ReducedStep:
        """This step's folded states merged over ``group`` (``Window`` syncs its
        reporter's through it too)."""
        parts = SyncedParts(self._metric_records, self._table, self._plan, self.kind)
        return sync_reduce(parts, group=group, timeout=timeout)

    @_locked
    def device(self) -> torch.device:
        """Where this tracker's tensors live (the CPU when it holds none)."""
        self._fold()
        part = self._table.device_part
        return torch.device("cpu") if part is None else part.device

    @_locked
    def state(self) -> TrackerState:
        """A small picklable snapshot of this process's metrics (one host transfer).

        Raises:
            ValueError: a tensor log call was rejected (negative or non-finite weights,
                or non-finite values under ``nonfinite="error"``). The rejected calls were
                dropped and are reported once: the next call returns everything else.
        """
        return TrackerState(self._local_reduce().states())

    def take_state(self) -> TrackerState:
        """End this process's step without a sync: its ``state()``, and the tracker reset
        for the next step, in one hold of the lock. A call another thread makes lands
        whole in the step taken or in the next, never in neither (``state()`` then
        ``reset()`` drops the calls made between them). A worker's step for a driver to
        merge: ``Window.step()`` and ``rlmetrics.integrations.ray.with_metrics`` take their steps
        with it, and so should a collect loop of your own.

        Raises:
            ValueError: as ``state()`` (a rejected tensor call; a tensor changed in
                place): nothing is reset, and the next call returns everything else.
        """
        return self._take_state(None)

    @_locked
    def _take_state(self, accept: Callable[[TrackerState], None] | None) -> TrackerState:
        """``take_state()``; ``accept`` (``Window.step()``'s merge into its window) is
        called with the state before the reset, under the same hold of the lock, and
        when it raises, nothing is reset."""
        state = self.state()
        if accept is not None:
            accept(state)
        self.reset()
        return state

    def _local_reduce(self) -> ReducedStep:
        """This process's step in packed form (one host transfer)."""
        self._fold()
        return self._local_step()

    def _local_step(self) -> ReducedStep:
        """``_local_reduce`` after its fold: the folded state packed."""
        table = self._table
        try:
            return local_reduce(self._plan.local_packing(self._metric_records, table), table)
        except RejectedInputError:
            self._forget_rejected()
            raise

    def _forget_rejected(self) -> None:
        """Zero every rejected-call count once reported, and drop the metrics that only
        rejected calls created (as a python call that raises creates none). Reads the
        counts of those candidates only, on this error path."""
        table = self._table
        for name, records in list(self._metric_records.items()):
            if records.num_deferred_checks and not records.accepted_a_call:
                # python numbers are checked at once, never rejected later: they are
                # recognised by their effect on the host state, not marked on the fast path
                if table.rejected(records.row) >= records.num_deferred_checks and table.is_empty(
                    records.row, records.kind
                ):
                    del self._metric_records[name]
                    table.clear_row(records.row, records.kind)
                    continue
                records.accepted_a_call = True  # a checked call was taken
        table.forget_rejected()

    def merge(self, other: Tracker | TrackerState) -> Tracker:
        """Merge another tracker's metrics (or a state) into this one; returns self.

        The merge is the same associative, commutative one used between micro-batches,
        ranks and workers. Every metric is checked first (names, kinds, slot counts,
        kind configuration): a merge that fails leaves this tracker as it was.

        Another tracker's ``state()`` is taken before this tracker's lock, never under
        it, so ``a.merge(b)`` and ``b.merge(a)`` in two threads at once cannot deadlock;
        each merges a snapshot of the other (which may hold the other's own merge).
        """
        state = other.state() if isinstance(other, Tracker) else other
        if not isinstance(state, TrackerState):
            raise TypeError(f"merge expects a Tracker or TrackerState, got {type(other).__name__}")
        with self._lock:
            self._fold()  # this tracker's own calls come first: a merged state is another source
            kinds = self._checked_kinds(state, self._metric_records)
            self._merge_checked(state, kinds, self._merged_extras(state, kinds))
        return self

    def _checked_kinds(
        self, state: TrackerState, current: Mapping[str, MetricRecords]
    ) -> dict[str, Kind]:
        """The kind each of ``state``'s metrics merges into, all checked against the
        ``current`` metric records before anything changes."""
        kinds = {}
        for name, metric in state.metrics.items():
            check_name(name)
            records = current.get(name)
            kind_name = getattr(metric, "kind", None)
            if records is not None and records.kind.name != kind_name:
                raise ValueError(
                    f"metric {name!r} is kind {records.kind.name!r} here but {kind_name!r} in the "
                    "merged state"
                )
            # str: a metric without a kind (not a MetricState) is then an unknown kind
            kind = records.kind if records is not None else self.kind(str(kind_name))
            check_metric(name, metric, kind)
            kinds[name] = kind
        return kinds

    def _merged_extras(self, state: TrackerState, kinds: Mapping[str, Kind]) -> dict[str, Any]:
        """Each extra of ``state`` merged with this tracker's, before anything changes
        (a user kind's ``merge_extra`` may raise on any state).

        Raises:
            ValueError: naming the metric whose extra does not merge.
        """
        extras = {}
        for name, metric in state.metrics.items():
            kind = kinds[name]
            if carries_extra(kind):
                records = self._metric_records.get(name)
                extra = kind.empty_extra() if records is None else self._table.extras[records.row]
                extras[name] = merged_extra(name, extra, metric.extra, kind)
        return extras

    def _merge_checked(
        self,
        state: TrackerState,
        kinds: Mapping[str, Kind],
        extras: Mapping[str, Any] | None = None,
    ) -> None:
        """Load ``state``'s checked metrics (``extras``: their extras merged already)."""
        for name, metric in state.metrics.items():
            records = self._metric_records.get(name) or self._add_metric(name, kinds[name])
            records.accepted_a_call = True
            extra = UNMERGED if extras is None else extras.get(name, UNMERGED)
            self._table.load(records.row, metric, records.kind, extra)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the caches (``StepPlan``) and the lock."""
        with self._lock:
            self._fold()
            state = dict(self.__dict__)
            del state["_lock"], state["_plan"]
            return {**state, "_pool": dict(self._metric_records)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle with a new lock, and each metric on this process's kind object (a
        pickled kind arrives as a copy, which an agreed layout would not recognise)."""
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._plan = StepPlan()
        for records in self._metric_records.values():
            try:
                kind = self.kind(records.kind.name)
            except ValueError:  # a user kind not registered in this process: keep the copy
                continue
            if kind is not records.kind and kind.settings() == records.kind.settings():
                records.kind = kind

    @_locked
    def reset(self) -> None:
        """Forget every metric (a new step begins), the device timers not read yet and
        the calls with ``by=`` not split yet."""
        if self.device_timers.pending:
            self.device_timers.clear()
        if self._groups.pending:
            self._groups.clear()
        if self._numbers.values:  # a fold leaves none
            self._numbers.clear()
        self._checked_weight.clear()
        self._fold_errors = []
        # records are left only by calls since the last fold (a fold clears every one)
        if self._recorded and any(map(_get_values, self._metric_records.values())):
            for records in self._metric_records.values():
                records.clear()  # drops the records (the tensors they keep alive) now
        self._recorded = 0
        if len(self._pool) != len(self._metric_records):  # names not logged this step
            for name, records in self._pool.items():
                if name not in self._metric_records:
                    records.idle()
        if len(self._pool) > 2 * len(self._metric_records) + 256:  # names that come and go
            self._pool = dict(self._metric_records)
            self._table = self._table.compacted(list(self._pool.values()))
        else:
            self._table.clear()
        self._metric_records = {}

    @_locked
    def compute(
        self,
        reset: bool = True,
        *,
        group: Any = None,
        timeout: float | timedelta | None = None,
        sync: bool = True,
    ) -> dict[str, float]:
        """End the step: merge across the process group, return every metric's value.

        Syncs over ``group`` (a ProcessGroup, or a (DeviceMesh, dim name) pair) or, when
        None, over the default group if torch.distributed is initialised; ``sync=False``
        computes this process's values only. Every rank gets the same dict. This is the
        one place where the host waits on the device.

        Args:
            reset: start a new step afterwards (False keeps accumulating).
            group: the process group to merge over.
            timeout: seconds (or a timedelta) after which a missing rank raises.
            sync: False to skip the process group.

        Raises:
            ValueError: a tensor log call was rejected (see ``state``), or a logged
                tensor changed in place (``ModifiedInputError``; in a sync every rank
                raises); nothing is reset, and calling ``compute()`` again returns every
                other call's metrics. A call with ``by=`` dropped at the fold raises
                after the step, on its rank only.
        """
        # a C callable, where a lambda would be one more python call per step
        read = methodcaller("results", empty=self.empty)
        return self._end_step(read, reset, group, timeout, sync)

    @_locked
    def compute_state(
        self,
        reset: bool = True,
        *,
        group: Any = None,
        timeout: float | timedelta | None = None,
        sync: bool = True,
    ) -> TrackerState:
        """End the step as ``compute()`` does, with the same sync, and return the merged
        state instead of the values: what a driver merges further with other steps'
        states (several updates it reports as one step). ``state.compute()`` gives the
        dict ``compute()`` would have returned.

        Args and Raises: as ``compute()``.
        """
        return self._end_step(
            lambda reduced: TrackerState(reduced.states()), reset, group, timeout, sync
        )

    def _end_step(
        self,
        read: Callable[[ReducedStep], _Result],
        reset: bool,
        group: Any,
        timeout: float | timedelta | None,
        sync: bool,
    ) -> _Result:
        """The step merged over ``group`` (or this process's), read by ``read`` before
        the reset (a ``ReducedStep`` is read within the call that built it)."""
        if timeout is not None:
            as_timeout(timeout)  # a bad timeout raises even where nothing syncs
        dropped = None
        if sync and should_sync(group):
            dropped = self._fold_for_sync()
            try:
                reduced = self._synced_step(group, timeout)
            except RejectedInputError as error:
                self._forget_rejected()
                if dropped is not None:
                    raise dropped from error  # this rank's own reason
                raise
        else:
            self._fold()
            reduced = self._local_step()
        out = read(reduced)
        if reset:
            self.reset()
        if dropped is not None:
            raise dropped  # calls with by= dropped at this rank's fold: in no rank's result
        return out

    def _fold_for_sync(self) -> ValueError | None:
        """Fold before a sync; a fold error is returned, not raised, so that this rank
        still joins the step's collective (raising now would leave its peers' collective
        to pair with this rank's next one). The calls it dropped count as rejected, so
        that every rank raises after the sync; those of calls with ``by=`` (their
        metrics unknown) are returned for this rank to raise after the step."""
        try:
            self._fold()
        except ValueError as error:  # ModifiedInputError; calls with by= dropped
            calls = getattr(error, "calls", {})
            for name, count in calls.items():
                records = self._metric_records.get(name)
                if records is not None:
                    records.count(REJECTED_SLOT, float(count))
            return error
        return None

    # -- checkpointing ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A checkpointable dict (plain python and numpy) of the current step's metrics."""
        return self.state().to_dict()

    @_locked
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Replace this tracker's metrics with a ``state_dict()``'s.

        Raises:
            TypeError: ``state_dict`` is not a dict.
            MalformedStateError: (a ``ValueError``) the dict is damaged or foreign:
                a key missing, unknown or of the wrong type, an unknown version or kind,
                a state that does not fit its kind; the message names the key and the
                metric. Everything is checked first: the tracker is left unchanged.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                "load_state_dict(state_dict): expected the dict that state_dict() returns, "
                f"got {type(state_dict).__name__}"
            )
        state = TrackerState.from_dict(state_dict)
        kinds = checked_load(state, self.kind)  # a state that fails changes nothing
        self.reset()
        self._merge_checked(state, kinds)


__all__ = ["Labels", "LogTarget", "Loggable", "PrefixedTracker", "Tracker"]
