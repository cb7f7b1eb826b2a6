"""Tracker sync over torch.distributed: schema agreement and packed collectives.

A steady-state step reduces every scalar metric with one collective: an ``all_gather``
of the packed SUM and MAX buffers, reduced on the host (rows added in rank order, so
every rank gets the same bits; max over rows), or ``all_reduce(SUM)`` and
``all_reduce(MAX)`` above ``GATHER_LIMIT``. The MAX buffer ends with a tail (see
``rlmetrics._engine.group_layouts``) that tells every rank, without another collective, when some
rank logged a name its layout lacks or packed another layout; only then do ranks agree on
the schema again (a JSON gather) and repeat the reduce. Kinds with an extra payload
(std, dist) add one ``all_gather``.

Nothing here unpickles data that did not come from a rank of the same process group:
schemas travel as JSON, extras of built-in kinds as float64 tensors; only user kinds
whose extras cannot be packed travel pickled, and only between the group's ranks.

Replicas: merge over the data-parallel group only. Tensor- or pipeline-parallel copies
of a DP rank log the same values; to compute over a group that contains replicas, log
only on one copy (see ``is_replica_source``). Timeouts, groups and the collectives
themselves live in ``rlmetrics._engine.collectives``; the users' helpers in
``rlmetrics.distributed``.
"""

from __future__ import annotations

import json
import pickle
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from rlmetrics._engine.collectives import (
    all_gather,
    all_reduce,
    as_timeout,
    comm_device,
    gather_bytes,
    resolve_group,
    wait_for,
)
from rlmetrics._engine.group_layouts import TAIL, GroupLayouts
from rlmetrics._engine.layout import BufferLayout
from rlmetrics._engine.packing import Packing, in_order, restore_nans, unpack, with_nan_counts
from rlmetrics._engine.plan import same_metrics
from rlmetrics._engine.results import ReducedStep
from rlmetrics._engine.table import StateTable
from rlmetrics.kinds import kind_names
from rlmetrics.kinds.rank_time import family_kind

# Above this many gathered floats per step (ranks x packed buffer length), the step
# issues all_reduce(SUM) + all_reduce(MAX) instead of one all_gather: every collective
# has a fixed cost, but the gather's traffic and host work grow with the group. On gloo
# the gather stayed ahead well past this size (docs/scaling.md).
GATHER_LIMIT = 200_000


def _read_schema(rank: int, data: bytes) -> dict[str, Any]:
    """A rank's schema as ``agree_schema`` sent it: JSON of ``{"metrics": [[name, kind
    name, settings], ...], "kinds": {kind name: settings}}``.

    Raises:
        ValueError: naming the rank, for anything else (not JSON, another shape): the
            same error on every rank, since every rank reads every rank's schema.
    """
    try:
        schema = json.loads(data)
    except ValueError as error:
        raise ValueError(f"rank {rank} sent a schema that is not JSON: {error}") from error
    if (
        not isinstance(schema, dict)
        or not isinstance(schema.get("metrics"), list)
        or not isinstance(schema.get("kinds"), dict)
        or not all(
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and isinstance(entry[1], str)
            for entry in schema["metrics"]
        )
    ):
        raise ValueError(
            f"rank {rank} sent a schema of another form than rlmetrics sends "
            f"(another version of rlmetrics on that rank?): {bytes(data[:200])!r}"
        )
    return schema


def agree_schema(
    tracker: Any, group: Any, device: torch.device, timeout: timedelta | None
) -> BufferLayout:
    """The union of every rank's (name, kind) pairs.

    Each rank sends its metrics' (name, kind name, ``Kind.settings()``) and the settings
    of every kind it would report with (its own ``dist`` and ``quantile``, and each
    registered kind), so that a rank which did not log a name still reports it alike.

    Raises:
        ValueError: on every rank, when ranks log a name with two kinds, or with one
            kind configured two ways (a histogram with other edges, a ``dist`` with
            other quantiles), or a kind some rank has not registered; naming the metric
            and both settings.
    """
    kinds = {name: tracker.kind(name).settings() for name in kind_names()}
    local = sorted(
        (name, acc.kind.name, acc.kind.settings()) for name, acc in tracker.accumulators.items()
    )
    payload = json.dumps({"metrics": local, "kinds": kinds}).encode()
    sent = [
        _read_schema(rank, data)
        for rank, data in enumerate(gather_bytes(payload, group, device, timeout))
    ]
    union: dict[str, tuple[str, str, int]] = {}
    conflicts: dict[str, str] = {}  # the first per metric
    for rank, rank_sent in enumerate(sent):
        for name, kind_name, settings in rank_sent["metrics"]:
            seen_kind, seen_settings, seen_rank = union.setdefault(
                name, (kind_name, settings, rank)
            )
            if seen_kind != kind_name:
                conflicts.setdefault(
                    name,
                    f"metric {name!r} is kind {seen_kind!r} on rank {seen_rank} "
                    f"but kind {kind_name!r} on rank {rank}",
                )
            elif seen_settings != settings:
                conflicts.setdefault(
                    name,
                    f"metric {name!r} has kind {kind_name!r} configured as {seen_settings!r} "
                    f"on rank {seen_rank} but as {settings!r} on rank {rank}",
                )
    for name, (kind_name, settings, seen_rank) in union.items():
        for rank, rank_sent in enumerate(sent):
            theirs = rank_sent["kinds"].get(kind_name)
            if theirs is None and family_kind(kind_name) is None:
                conflicts.setdefault(
                    name,
                    f"metric {name!r} has kind {kind_name!r} on rank {seen_rank}, which rank "
                    f"{rank} has not registered",
                )
            elif theirs is not None and theirs != settings:
                conflicts.setdefault(
                    name,
                    f"metric {name!r} has kind {kind_name!r} configured as {settings!r} "
                    f"on rank {seen_rank} but as {theirs!r} on rank {rank}",
                )
    if conflicts:
        raise ValueError("ranks disagree on metric kinds: " + "; ".join(conflicts.values()))
    return BufferLayout(
        [(name, tracker.kind(kind_name)) for name, (kind_name, _, _) in union.items()]
    )


@dataclass(eq=False)
class GroupSync:
    """What a tracker keeps per process group between steps (in its ``StepPlan``): its
    agreed layout (None until it has one), the group's ``GroupLayouts`` (the same on
    every rank), the device collectives run on, the host buffer a CPU gather writes
    into, and the last step's packing.

    The packing is reused by ``StepPlan``'s rule (the same accumulators, rows not
    renumbered) while it was made for the current layout and the group's padded sizes
    are the same object.
    """

    layout: BufferLayout | None
    agreed: GroupLayouts
    device: torch.device
    world: int
    gathered: np.ndarray | None = None  # (world size, packed length), CPU groups only
    rows: list[Tensor] = field(default_factory=list)  # views of ``gathered``'s rows
    seen: list[Any] = field(default_factory=list)  # the last packing's accumulators
    packing: Packing | None = None

    def packing_for(self, accumulators: Mapping[str, Any], table: StateTable) -> Packing:
        """How this rank packs this step: its accumulators in layout order, the group's
        padded sizes, and at the MAX part's end per placement whether this rank logged
        it and the tail. A step that logged a name the layout lacks packs as empty with
        "changed" set, and a tracker with no layout the group holds packs an empty one
        with "changed" set, so every rank agrees again."""
        current = list(accumulators.values())
        packing, sizes = self.packing, self.agreed.sizes
        if (
            packing is not None
            and packing.layout is self.layout
            and packing.sizes is sizes
            and same_metrics(self.seen, current)
        ):
            return packing
        layout = self.layout
        if layout is None or not self.agreed.holds(layout):
            layout = self.layout = self.agreed.guess(accumulators)
        fits = layout is not None and layout.fits(accumulators)
        tail = (
            [0.0, layout.digest, -layout.digest] if fits and layout is not None else [1.0, 0.0, 0.0]
        )
        layout = layout or _NO_LAYOUT
        accs = in_order(accumulators if fits else {}, layout)
        end = np.zeros(sizes.maxes - layout.num_maxes)
        end[: len(accs)] = [acc is not None for acc in accs]  # this rank logged the name
        end[-TAIL:] = tail
        packing = Packing.make(layout, accs, table, sizes.sums, end)
        packing.sizes, packing.logged_all = sizes, fits and None not in accs
        if fits:
            self.seen, self.packing = current, packing
        return packing

    def gather_rows(self, world: int, length: int) -> tuple[np.ndarray, list[Tensor]]:
        """The reusable (world, length) host buffer and its rows as CPU tensors."""
        if self.gathered is None or self.gathered.shape != (world, length):
            self.gathered = np.empty((world, length))
            self.rows = [torch.from_numpy(row) for row in self.gathered]
        return self.gathered, self.rows

    def forget_packing(self) -> None:
        """Drop the last packing (the table's rows were renumbered); the agreed layout
        stays, since it names metrics, not rows."""
        self.packing, self.seen = None, []


_NO_LAYOUT = BufferLayout([])  # what a rank without a layout the group holds packs

# Per process group, the layouts agreed over it (keyed by the group object, weakly):
# the same on every rank of the group, unlike each tracker's own cache.
_GROUP_LAYOUTS: weakref.WeakKeyDictionary[Any, GroupLayouts] = weakref.WeakKeyDictionary()


def _group_sync(tracker: Any, group: Any, wait: timedelta | None) -> GroupSync:
    """The tracker's sync state for ``group`` (kept in its ``StepPlan``); on the
    group's first sync in this process (so on every rank's), the schema agreed first."""
    cache = tracker.plan.group_syncs
    sync = cache.get(group)
    if isinstance(sync, GroupSync):
        return sync
    device, layout = comm_device(group), None
    agreed = _GROUP_LAYOUTS.get(group)
    if agreed is None:  # no tracker synced over this group yet, on any rank
        agreed = _GROUP_LAYOUTS[group] = GroupLayouts()
        layout = agree_schema(tracker, group, device, wait)
        agreed.use(layout)
    # else the step itself tells whether this rank's guess is its peers' layout
    sync = cache[group] = GroupSync(layout, agreed, device, dist.get_world_size(group))
    return sync


def sync_reduce(
    tracker: Any, *, group: Any = None, timeout: float | timedelta | None = None
) -> ReducedStep:
    """The tracker's step merged over ``group`` (every rank gets the same).

    Names in the cached layout that no rank logged this step are left out of the
    result, as a single process would leave them out.
    """
    pg = resolve_group(group)
    wait = as_timeout(timeout)
    sync = _group_sync(tracker, pg, wait)
    accumulators, table = tracker.accumulators, tracker.table
    tracker.plan.valid_for(table)
    for _ in range(2):
        packing = sync.packing_for(accumulators, table)
        sums, maxes = _reduce(packing, table, sync, pg, wait)
        changed, high, neg_low = maxes[-TAIL:].tolist()
        if changed == 0 and high == -neg_low:
            layout = packing.layout
            sync.agreed.use(layout)  # every rank packed this layout
            size = layout.num_maxes
            # when this rank logged every name, so did the group
            logged = None if packing.logged_all else maxes[size : size + len(layout.placements)]
            sums, maxes = sums[: layout.num_sums], maxes[:size]
            gather = partial(_gather_extras, group=pg, device=sync.device, wait=wait)
            return unpack(packing, table, sums, maxes, sync.device, logged, gather)
        sync.layout = agree_schema(tracker, pg, sync.device, wait)
        sync.agreed.use(sync.layout)
    raise RuntimeError("rlmetrics sync: ranks did not settle on a schema after re-agreeing")


def _reduce(
    packing: Packing, table: StateTable, sync: GroupSync, group: Any, wait: timedelta | None
) -> tuple[np.ndarray, np.ndarray]:
    """The packed SUM part and MAX part (its end included) reduced over ``group``, on
    the host (one device-to-host copy): one gather up to ``GATHER_LIMIT`` gathered
    floats, else two all_reduces. Every rank's buffer has the group's padded sizes,
    whatever layout it packed."""
    world, split = sync.world, packing.sum_part
    packed = packing.pack(table, sync.device)
    if world * packed.numel() <= GATHER_LIMIT:
        what = "all_gather of metric states"
        if packed.device.type == "cpu":  # straight into a reused host buffer
            gathered, rows = sync.gather_rows(world, packed.numel())
            wait_for(dist.all_gather(rows, packed, group=group, async_op=True), wait, what)
        else:
            gathered = torch.stack(all_gather(packed, group, wait, what)).cpu().numpy()
        return _merge_rows(gathered, split)
    packed = with_nan_counts(packed, split)
    middle = (packed.numel() + split) // 2  # [SUM part | NaN counts | MAX part]
    all_reduce(packed[:middle], dist.ReduceOp.SUM, group, wait, "all_reduce(SUM) of metric states")
    all_reduce(packed[middle:], dist.ReduceOp.MAX, group, wait, "all_reduce(MAX) of metric states")
    host = packed.cpu().numpy()
    return host[:split], restore_nans(host[split:middle], host[middle:])


def _merge_rows(gathered: np.ndarray, num_sums: int) -> tuple[np.ndarray, np.ndarray]:
    """The gathered rows' SUM parts added in rank order (every rank gets the same bits)
    and their MAX parts' elementwise max (NaN wins, as in a single process). With one
    rank, views of ``gathered``."""
    sums, maxes = gathered[:, :num_sums], gathered[:, num_sums:]
    if len(gathered) == 1:
        return sums[0], maxes[0]
    total = sums[0] + sums[1]
    for row in sums[2:]:
        total += row
    return total, maxes.max(axis=0) if len(gathered) > 2 else np.maximum(maxes[0], maxes[1])


def _gather_extras(
    vector: Tensor,
    objects: dict[str, object],
    group: Any,
    device: torch.device,
    wait: timedelta | None,
) -> tuple[list[np.ndarray], list[dict[str, object]]]:
    """Every rank's extras gather buffer (when any extra packs) and dict of extras that
    do not pack (when any; by byte gather), in rank order."""
    buffers: list[np.ndarray] = []
    if vector.numel():
        rows = all_gather(vector, group, wait, "extras gather")
        buffers = list(torch.stack(rows).cpu().numpy())  # one device-to-host copy
    gathered: list[dict[str, object]] = []
    if objects:  # user kinds whose extras cannot be packed
        payloads = gather_bytes(pickle.dumps(objects), group, device, wait)
        gathered = [pickle.loads(p) for p in payloads]  # only from this group's ranks
    return buffers, gathered


__all__ = ["GATHER_LIMIT", "agree_schema", "sync_reduce"]
