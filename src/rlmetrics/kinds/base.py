"""The aggregation-kind protocol: fixed state slots, reduce, merge, result.

A kind describes how a step's logged values reduce to a small state (``reduce``, over a
``Batch`` of all its metrics' records) and how two states merge.
Every state has the same shape:

* ``sums``: slots merged by addition,
* ``maxes``: slots merged by ``max`` (a minimum is stored negated),
* ``extra``: an optional payload with its own merge (std's Chan triple, dist's values).

Because ``sums`` and ``maxes`` merge elementwise, the states of many metrics pack into
one buffer each, and a whole step's scalar metrics sync with one collective (a gather
of both buffers, or an ``all_reduce(SUM)`` and an ``all_reduce(MAX)`` in large groups).
Only ``extra`` needs a gather of its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np

from rlmetrics.kinds.batch import Array, Batch

if TYPE_CHECKING:
    from rlmetrics.kinds.extra import ExtraKind

NUM_COUNTS = 2
"""Framework counts every metric carries besides its kind's slots: [num_nonfinite,
num_rejected] (additive; on the host kept apart, appended to ``dev_sums`` on a device)."""
NONFINITE_SLOT = -2
REJECTED_SLOT = -1


@dataclass(frozen=True, slots=True)
class MetricState:
    """A metric's mergeable snapshot: plain host numbers, small and picklable.

    Attributes:
        kind: the registered name of the metric's kind.
        sums: additive slots (the kind's own, without the framework counts).
        maxes: max-merged slots.
        extra: the kind's extra payload (host objects), or None.
        num_nonfinite: non-finite elements dropped under ``nonfinite="skip"``.
        fingerprint: the kind's ``fingerprint()`` where the state was made: its slot
            layout and configuration, e.g. a histogram's edges. "" for a state made by
            hand (``MetricState(...)``, a state dict without the key), which skips the
            check.
    """

    kind: str
    sums: tuple[float, ...]
    maxes: tuple[float, ...] = ()
    extra: Any = None
    num_nonfinite: float = 0.0
    fingerprint: str = ""

    def merge(self, other: MetricState, kind: Kind) -> MetricState:
        """Merge two states of the same kind; neither input changes."""
        if len(self.sums) != len(other.sums) or len(self.maxes) != len(other.maxes):
            raise ValueError(
                f"cannot merge two {self.kind!r} states with different slot counts "
                f"({len(self.sums)}+{len(self.maxes)} vs {len(other.sums)}+{len(other.maxes)}): "
                "the kind is configured differently where they were made"
            )
        if self.fingerprint and other.fingerprint and self.fingerprint != other.fingerprint:
            raise ValueError(
                f"cannot merge two {self.kind!r} states of different configurations "
                f"({self.fingerprint!r} vs {other.fingerprint!r})"
            )
        return MetricState(
            self.kind,
            tuple(a + b for a, b in zip(self.sums, other.sums, strict=True)),
            tuple(nan_max(a, b) for a, b in zip(self.maxes, other.maxes, strict=True)),
            kind.merge_extra(self.extra, other.extra) if carries_extra(kind) else None,
            self.num_nonfinite + other.num_nonfinite,
            self.fingerprint or other.fingerprint,
        )


ResultColumns = tuple[dict[str, np.ndarray], np.ndarray]
"""What ``Kind.result_columns`` returns: per result suffix, the metrics' values; and
whether each metric is present."""


def carries_extra(kind: Kind) -> TypeGuard[ExtraKind]:
    """Whether ``kind`` has an extra payload (``has_extra``). ``register_kind`` accepts
    has_extra=True only on an ``ExtraKind``, so the type checker may narrow to it."""
    return kind.has_extra


def nan_max(a: float, b: float) -> float:
    """max that propagates NaN, like torch.maximum and all_reduce(MAX) on most backends."""
    if a != a or b != b:
        return math.nan
    return a if a >= b else b


class Kind:
    """Base class of aggregation kinds; subclass it to define your own.

    A kind declares its state: ``num_sums`` additive slots and ``num_maxes`` max slots.
    It implements ``reduce`` and ``result``. ``reduce`` turns a step's records of all the
    kind's metrics into one state row per metric, in one vectorised pass (see
    ``rlmetrics.kinds.batch``). The merge follows from the declaration: sums add, maxes
    take the max. A kind whose new value replaces the rank's state (``last``) sets
    ``keeps_latest``.

    A kind whose every slot is a sum or a max of a per-element column may declare the
    columns instead of writing ``reduce`` (``sum_columns``, ``max_columns``; the slot
    counts follow). Mean's are Σ value·weight and Σ weight (``COLUMNS`` in
    ``rlmetrics.kinds.batch``). The default ``reduce`` then takes one sum or one max per
    column over all the kind's metrics, however many were logged. A replacing kind's
    declared slots are its columns at each metric's last selected element.

    Extension: a kind with a payload that is neither additive nor a max (std's moments,
    dist's values) subclasses ``rlmetrics.kinds.extra.ExtraKind`` instead. Its payload is
    gathered at sync.
    """

    name: str = ""
    num_sums: int = 0
    num_maxes: int = 0
    has_extra: bool = False  # True for an ``ExtraKind``
    keeps_latest: bool = False
    """True for kinds whose new value replaces the rank's state (``last``); a call then
    takes one element."""
    sum_columns: tuple[str, ...] = ()
    """Per SUM slot, the column (``Batch.COLUMNS``) whose sum over a metric's elements it
    holds; declared with ``max_columns`` instead of writing ``reduce``."""
    max_columns: tuple[str, ...] = ()
    """Per MAX slot, the column whose max over a metric's elements it holds."""
    parts: int = 1
    """Into how many equal parts each call's elements split (``Batch.chunk_index``); a
    call must hold a multiple of it (checked in the log call)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "sum_columns" in cls.__dict__ or "max_columns" in cls.__dict__:
            cls.num_sums, cls.num_maxes = len(cls.sum_columns), len(cls.max_columns)

    @property
    def slots_declared(self) -> bool:
        """Whether the declared columns are exactly the slots (none declared: no slots)."""
        return (self.num_sums, self.num_maxes) == (len(self.sum_columns), len(self.max_columns))

    def fingerprint(self) -> str:
        """What must match across processes for two states of this kind to merge: the
        name and slot layout. Kinds with parameters that change the meaning of their
        slots (a histogram's edges) override it to include them."""
        return f"{self.name}:{self.num_sums}:{self.num_maxes}:{int(self.has_extra)}"

    def settings(self) -> str:
        """Everything ranks must configure alike for one ``compute()`` to report the same
        keys and values everywhere: the ``fingerprint()`` (what the slots mean) and, for a
        kind that overrides ``config()``, its parameters (quantiles, a histogram's bins).
        The sync's schema agreement compares it across processes, so ``config()`` must
        hold values whose ``repr`` reads the same in each (numbers, strings, tuples); a
        merge of states compares only the fingerprint, since the process that merges
        reports with its own kind."""
        if type(self).config is Kind.config:  # identity: no parameters to compare
            return self.fingerprint()
        return f"{self.fingerprint()} config={self.config()!r}"

    def reduce(self, batch: Batch) -> tuple[Array, Array]:
        """One state row per metric of ``batch``: (sums, maxes) of shapes
        (batch.num_rows, num_sums) and (batch.num_rows, num_maxes), float64, on the
        batch's backend, with a fixed number of operations (no host sync on a device).

        An element with weight 0 must not contribute (its value is 0 by then). The
        default reduces the declared ``sum_columns`` and ``max_columns`` (for a kind
        that ``keeps_latest``: takes them at each row's last selected element)."""
        if self.keeps_latest:
            batch = batch.last_elements()
        return (
            batch.columns(*map(batch.column_sum, self.sum_columns)),
            batch.columns(*map(batch.column_max, self.max_columns)),
        )

    # -- result: implement ``result``, or ``result_columns`` alone ----------------------
    def result_columns(
        self,
        sums: np.ndarray,
        maxes: np.ndarray,
        extras: Sequence[Any] | None,
        names: Sequence[str],
    ) -> ResultColumns:
        """The results of n metrics at once from their merged states: (n, num_sums) and
        (n, num_maxes) slots, and (kinds with an extra) the n host extras; ``names`` for
        messages. Returns, per result suffix ('' for the bare name, 'p50' for
        ``name/p50``), an (n,) array of values, and an (n,) bool array: whether each
        metric is present (not empty).

        This is what reports a kind's results. The default calls ``result`` per metric;
        kinds with many metrics per step override this instead, with array arithmetic,
        and then need no ``result``."""
        rows = []
        for i, name in enumerate(names):
            extra = None if extras is None else extras[i]
            state = MetricState(self.name, tuple(sums[i].tolist()), tuple(maxes[i].tolist()), extra)
            rows.append(self.result(state, name))
        present = np.array([row is not None for row in rows], dtype=bool)
        suffixes = dict.fromkeys(s for row in rows if row for s in row)
        columns = {
            suffix: np.array([row.get(suffix, math.nan) if row else math.nan for row in rows])
            for suffix in (suffixes or self.result_names())
        }
        return columns, present

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        """One metric's values: {"": value} for the bare name, {"p50": ...} for
        ``name/p50``; None when the state is empty. The simplest way to state a kind's
        result: the default ``result_columns`` calls it per metric. Read a metric's result
        with ``result_of``, which works whichever of the two a kind implements."""
        raise NotImplementedError(
            f"{type(self).__name__} implements neither result nor result_columns"
        )

    def result_names(self) -> tuple[str, ...]:
        """The suffixes ``result`` may return ('' for the bare name), for NaN reports."""
        return ("",)

    def config(self) -> tuple:
        """What makes two instances the same kind (``==`` and ``hash``): by default the
        instance itself; configurable kinds return their parameters."""
        return (id(self),)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.config() == self.config()

    def __hash__(self) -> int:
        return hash((type(self), self.config()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def result_of(kind: Kind, state: MetricState, name: str = "") -> dict[str, float] | None:
    """One metric's values from its state (as ``Kind.result`` returns them), read
    through ``kind.result_columns``: the same for a kind that states its result per
    metric or vectorised, since ``result_columns`` defaults to ``result`` and never the
    other way round."""
    extras = [state.extra] if kind.has_extra else None
    columns, present = kind.result_columns(
        np.array(state.sums, dtype=np.float64).reshape(1, -1),
        np.array(state.maxes, dtype=np.float64).reshape(1, -1),
        extras,
        [name],
    )
    if not present[0]:
        return None
    return {suffix: float(column[0]) for suffix, column in columns.items()}
