"""``StepPlan``: the one owner of everything a tracker keeps between steps.

A steady-state step logs the same metrics as the last one, so what the fold and the
packing derive from the set of metrics (the fold plan per device, with its table
positions and the layout of the flat numbers; the packing of ``compute(sync=False)``
and ``state()``; per process group, the packing of the sync; the device copies of
index arrays) is made once and reused. Each tracker holds one ``StepPlan``
(``Tracker.plan``); pickling or copying a tracker gives the copy a new, empty one.

The one invalidation rule: an entry is reused while the step's accumulators are the
same objects, in the same order, as those it was made for (``same_metrics``), and the
table's rows keep their numbering (``StateTable.version``); a new version drops every entry
made from rows. Identity is enough because a tracker keeps each name's accumulator
across steps while its kind stays and never files one object under two names
(``Tracker._accumulator``), so the same objects mean the same names, kinds and rows.

What is the same on every rank of a process group (the layouts agreed over it) is not
per tracker: it lives in ``rlmetrics._engine.sync``, per group.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from rlmetrics._engine.fold_plan import Plan
from rlmetrics._engine.layout import BufferLayout
from rlmetrics._engine.packing import Packing, in_order
from rlmetrics._engine.table import StateTable
from rlmetrics.kinds.base import MetricRecords
from rlmetrics.kinds.batch import to_device

MAX_DEVICE_INDICES = 256
"""Device index copies kept before the cache is emptied (arrays of metric sets that
came and went)."""


class GroupPacking(Protocol):
    """A tracker's state for one process group (``rlmetrics._engine.sync.GroupSync``),
    as far as the plan needs it."""

    def forget_packing(self) -> None:
        """Drop what was made from the table's rows; keep what names metrics only."""


def same_metrics(made_for: list[MetricRecords], accs: list[MetricRecords]) -> bool:
    """Whether an entry made for the accumulators ``made_for`` serves ``accs``: the
    same objects in the same order (see the module's invalidation rule)."""
    return len(made_for) == len(accs) and all(map(_is, made_for, accs))


def _is(a: object, b: object) -> bool:
    return a is b


class StepPlan:
    """Every cache of one tracker (see the module docstring for the rule).

    Attributes:
        group_syncs: per process group (keyed by the group object, weakly; never by
            id(), which a new group may reuse on some ranks only), the tracker's sync
            state: its agreed layout and the last packing for that group.
    """

    def __init__(self) -> None:
        self._version: int | None = None  # the table row numbering the entries were made for
        self._folds: dict[torch.device | None, tuple[list[MetricRecords], Plan]] = {}
        self._local: tuple[list[MetricRecords], Packing] | None = None
        self._indices: dict[tuple[int, torch.device], tuple[np.ndarray, Tensor]] = {}
        self.group_syncs: weakref.WeakKeyDictionary[Any, GroupPacking] = weakref.WeakKeyDictionary()

    def __reduce__(self) -> tuple[type[StepPlan], tuple[()]]:
        return StepPlan, ()  # a copy starts empty: its entries name the original's objects

    def valid_for(self, table: StateTable) -> None:
        """Drop every entry made from rows when ``table``'s rows were renumbered since."""
        if table.version != self._version:
            self._version = table.version
            self._folds.clear()
            self._local = None
            self._indices.clear()
            for sync in self.group_syncs.values():
                sync.forget_packing()

    def fold_plan(
        self, table: StateTable, device: torch.device | None, accs: list[MetricRecords]
    ) -> Plan:
        """The plan of ``accs`` folding on ``device`` (None: the host); the last one per
        device is kept."""
        self.valid_for(table)
        cached = self._folds.get(device)
        if cached is not None and same_metrics(cached[0], accs):
            return cached[1]
        plan = Plan(accs, table)
        self._folds[device] = (accs, plan)
        return plan

    def local_packing(
        self, accumulators: Mapping[str, MetricRecords], table: StateTable
    ) -> Packing:
        """The packing of this process's step alone (``compute(sync=False)``,
        ``state()``), its layout the accumulators' order."""
        self.valid_for(table)
        accs = list(accumulators.values())
        local = self._local
        if local is None or not same_metrics(local[0], accs):
            layout = BufferLayout([(name, acc.kind) for name, acc in accumulators.items()])
            local = self._local = (
                accs,
                Packing.make(layout, in_order(accumulators, layout), table),
            )
        return local[1]

    def index_on(self, positions: np.ndarray, device: torch.device) -> Tensor:
        """``positions`` (an index array a fold plan keeps across steps) on ``device``,
        copied there once per array rather than once per step."""
        key = (id(positions), device)
        cached = self._indices.get(key)
        if cached is None or cached[0] is not positions:
            if len(self._indices) > MAX_DEVICE_INDICES:
                self._indices.clear()
            cached = self._indices[key] = (positions, to_device(positions, device))
        return cached[1]
