"""The sync stage: a step's packed states merged over a process group, with collectives
that raise instead of hanging.

A steady-state step reduces every scalar metric with one collective: an ``all_gather``
of the packed SUM and MAX buffers, reduced on the host (rows added in rank order, so
every rank gets the same bits; max over rows), or ``all_reduce(SUM)`` and
``all_reduce(MAX)`` above ``GATHER_LIMIT``. Kinds with an extra payload (std, dist) add
one ``all_gather``.

A step's collective must have the same size on every rank, or the backend pairs the
wrong messages (gloo aborts the process). A tracker's own cache cannot decide that size:
a tracker created or unpickled on one rank only has none, and one rank's tracker may
cache another layout than its peers'. So ``GroupLayouts`` holds, per process group and
process (not per tracker), the layouts agreed over the group most recently. Every rank
changes it at the same points of the same collective sequence (an agreement, whose union
every rank computes alike, and a step whose reduced tail every rank reads alike), so it
is the same on every rank of the group whatever their trackers cache. A step's buffers
are padded to the largest of these layouts.

Each rank packs its step in the newest of these layouts that holds all its names, so a
tracker that comes back to a set of names the group agreed on recently (sets logged in
turn, a Window's phases) pays the one collective, not an agreement. The layout each rank
packed travels in the MAX buffer's last ``TAIL`` floats (its digest, and the digest
negated, so that the reduced tail holds the largest and the smallest): ranks that logged
other sets and picked other layouts, or a rank that logged a name no recent layout has
(it marks "changed"), show in every rank's reduced tail, without another collective;
the ranks then agree on the schema again (``rlmetrics._engine.schema``: a JSON gather)
and repeat the reduce. A rank that logged nothing packs its merge's identity in every
slot and no digest, so it fits whatever layout its peers packed: it reads the peers'
digest from the reduced tail and unpacks in that layout.

Every collective is issued with ``async_op=True`` and waited on with the timeout, so a
rank that died or never arrives raises ``SyncTimeoutError`` on the others (with gloo;
with NCCL the host wait is bounded by the process group's own timeout and watchdog, set
through ``init_process_group(timeout=...)``). The users' helpers
(``rlmetrics.distributed``) use the same guarded collectives.

Nothing here unpickles data that did not come from a rank of the same process group:
schemas travel as JSON, extras of built-in kinds as float64 tensors; only user kinds
whose extras cannot be packed travel pickled, and only between the group's ranks.

Replicas: merge over the data-parallel group only. Tensor- or pipeline-parallel copies
of a DP rank log the same values; to compute over a group that contains replicas, log
only on one copy (see ``is_replica_source``).
"""

from __future__ import annotations

import math
import numbers
import pickle
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from rlmetrics._engine.layout import BufferLayout
from rlmetrics._engine.packing import (
    Packing,
    ReducedStep,
    in_order,
    restore_nans,
    unpack,
    with_nan_counts,
)
from rlmetrics._engine.plan import RecentEntries, StepPlan
from rlmetrics._engine.record import MetricRecords
from rlmetrics._engine.schema import KindOf, agreed_layout, schema_payload
from rlmetrics._engine.table import StateTable
from rlmetrics.errors import SyncTimeoutError

# Longer waits count as no timeout: gloo adds the wait to a nanosecond clock, which
# overflows (the wait then fails at once) from about 9e9 s.
MAX_TIMEOUT_S = 1e9


def should_sync(group: Any) -> bool:
    """Whether ``compute()`` merges over a process group."""
    return group is not None or is_initialized()


def resolve_group(group: Any) -> Any:
    """A ProcessGroup from None (the default group), a group, or (DeviceMesh, dim)."""
    if group is None:
        if not is_initialized():
            raise RuntimeError("compute(group=None) needs torch.distributed to be initialised")
        return dist.group.WORLD
    if isinstance(group, tuple):
        mesh, dim = group
        return mesh.get_group(mesh_dim=dim)
    get_group = getattr(group, "get_group", None)
    if get_group is not None and hasattr(group, "mesh_dim_names"):  # a 1-D DeviceMesh
        if group.ndim != 1:
            raise ValueError("pass (mesh, dim_name) to sync over one dimension of a DeviceMesh")
        return get_group()
    return _check_group(group)


def _check_group(group: Any) -> Any:
    """``group`` when it is a process group this process belongs to.

    Raises:
        ValueError: this process is not a member (``dist.new_group`` returns
            ``GroupMember.NON_GROUP_MEMBER`` on the ranks it leaves out).
        TypeError: ``group`` is not a process group.
    """
    if isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"group: this process (global rank {dist.get_rank()}) is not a member of the "
            "process group passed (dist.new_group returns GroupMember.NON_GROUP_MEMBER on "
            "the ranks it leaves out); call compute(group=g) only on g's ranks, or "
            "compute(sync=False) for this process's own values"
        )
    raise TypeError(
        "group must be a ProcessGroup, a DeviceMesh or a (DeviceMesh, dim name) pair, got "
        f"{type(group).__name__} {group!r}"
    )


def is_initialized() -> bool:
    """Whether torch.distributed is available and initialised in this process."""
    return dist.is_available() and dist.is_initialized()


def comm_device(group: Any) -> torch.device:
    """The device collectives of ``group`` run on: CUDA for NCCL, else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def as_timeout(timeout: float | timedelta | None) -> timedelta | None:
    """A sync timeout as a timedelta, or None for the process group's own.

    ``math.inf`` (or any wait beyond ``MAX_TIMEOUT_S``) means no bound of rlmetrics':
    the backend's own timeout (``init_process_group(timeout=...)``) still bounds every
    collective, and longer waits overflow inside gloo (it then times out at once).

    Raises:
        TypeError: ``timeout`` is not a number, a timedelta or None.
        ValueError: ``timeout`` is zero, negative or NaN.
    """
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"timeout must be seconds (a number), a timedelta or None, got "
            f"{type(timeout).__name__} {timeout!r}"
        )
    if not seconds > 0:  # NaN too
        raise ValueError(
            f"timeout must be > 0 seconds (None or math.inf: the process group's own "
            f"timeout), got {timeout!r}"
        )
    if seconds > MAX_TIMEOUT_S:
        return None
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)


def wait_for(work: Any, timeout: timedelta | None, what: str) -> None:
    """Wait for an async collective; raise SyncTimeoutError naming it on failure."""
    start = time.monotonic()
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
    except Exception as error:  # gloo raises RuntimeError/DistBackendError on timeout
        # the backend's reason tells a timeout (hang) from a closed connection (death)
        cause = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise SyncTimeoutError(
            f"rlmetrics sync: {what} did not complete"
            + (f" within {timeout.total_seconds():g} s" if timeout is not None else "")
            + f" (failed after {time.monotonic() - start:.1f} s: {cause}); "
            "a rank may have died, hung, or not called compute()"
        ) from error


def all_reduce(tensor: Tensor, op: Any, group: Any, timeout: timedelta | None, what: str) -> None:
    """An in-place all_reduce that raises SyncTimeoutError instead of hanging."""
    wait_for(dist.all_reduce(tensor, op=op, group=group, async_op=True), timeout, what)


def all_gather(tensor: Tensor, group: Any, timeout: timedelta | None, what: str) -> list[Tensor]:
    """All ranks' equal-sized ``tensor``s, in rank order."""
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    wait_for(dist.all_gather(out, tensor, group=group, async_op=True), timeout, what)
    return out


def gather_bytes(
    payload: bytes, group: Any, device: torch.device, timeout: timedelta | None
) -> list[bytes]:
    """All ranks' byte strings (two all_gathers: lengths, then padded bytes)."""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = [int(n) for n in all_gather(length, group, timeout, "schema length gather")]
    buffer = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    pieces = all_gather(buffer, group, timeout, "schema gather")
    return [bytes(p[:n].cpu().numpy().tobytes()) for p, n in zip(pieces, lengths, strict=True)]


TAIL = 3  # a packed buffer's last floats: [schema changed, layout hash, -layout hash]
RECENT = 8  # layouts kept per group: trackers that share a group keep their own


@dataclass(frozen=True)
class Sizes:
    """A group's padded buffer sizes (the largest of its recent layouts'): every rank
    packs ``[SUM | pad | MAX | logged | pad | tail]``, gathered whole, or with NaN counts
    of the MAX part inserted (``packing.with_nan_counts``) reduced as an
    all_reduce(SUM) of ``sums + maxes`` floats and an all_reduce(MAX) of ``maxes``.

    Attributes:
        sums: the SUM part's length, [SUM | pad].
        maxes: the MAX part's length, [MAX | logged | pad | tail].
    """

    sums: int = 0
    maxes: int = TAIL


def layout_sizes(layout: BufferLayout) -> Sizes:
    """The unpadded sizes of ``layout``'s buffer."""
    return Sizes(layout.num_sums, layout.num_maxes + len(layout.placements) + TAIL)


class GroupLayouts:
    """The layouts this process agreed over one group, newest first (at most
    ``RECENT``), and the padded buffer sizes every rank of the group uses."""

    def __init__(self) -> None:
        self.layouts: list[BufferLayout] = []
        self.sizes = Sizes()

    def use(self, layout: BufferLayout) -> None:
        """Record that every rank of the group agreed on (or reduced a step in)
        ``layout``: it moves to the front; the oldest layout beyond ``RECENT`` drops.

        ``sizes`` is replaced only when the set of layouts changes, so a packing can
        tell whether its padding still holds by identity.
        """
        layouts = self.layouts
        if layouts and layouts[0] is layout:
            return
        digest = layout.digest
        others = [known for known in layouts if known.digest != digest]
        self.layouts = [layout, *others][:RECENT]
        if len(others) == len(layouts):  # a new member (the oldest may have dropped)
            every = [layout_sizes(known) for known in self.layouts]
            self.sizes = Sizes(max(s.sums for s in every), max(s.maxes for s in every))

    def newest_fitting(
        self,
        metric_records: Mapping[str, MetricRecords],
        known: BufferLayout | None = None,
        own: Mapping[float, BufferLayout] | None = None,
    ) -> BufferLayout | None:
        """The layout a step of ``metric_records`` packs: the newest recent layout that
        holds all its names (None: none does, the ranks must agree again).

        The choice depends only on the group's layouts (the same on every rank) and
        the step's names, so ranks that log the same set pick the same layout, whatever
        their trackers cache. Ranks that log different sets may pick different ones:
        the step's tail tells, and every rank agrees again.

        Args:
            metric_records: the step's metrics.
            known: a layout already known to fit (a packing's for the same
                metric records), not checked again.
            own: by digest, the tracker's own copies of recent layouts: a layout is
                checked (and packed) as the tracker's copy, whose kind objects are the
                tracker's (two trackers' ``dist`` kinds are two objects, so another
                tracker's copy of the same layout does not hold this one's names).
        """
        for layout in self.layouts:
            if own:
                layout = own.get(layout.digest, layout)
            if layout is known or layout.fits(metric_records):
                return layout
        return None

    def with_digest(self, digest: float) -> BufferLayout:
        """The recent layout whose digest a step's tail carries.

        Raises:
            RuntimeError: none has it (the group's layouts differ between ranks, which
                the protocol rules out).
        """
        for layout in self.layouts:
            if layout.digest == digest:
                return layout
        raise RuntimeError(
            "rlmetrics sync: the ranks reduced a step in a layout this rank does not hold "
            "(the group's recent layouts differ between ranks)"
        )


# Above this many gathered floats per step (ranks x packed buffer length), the step
# issues all_reduce(SUM) + all_reduce(MAX) instead of one all_gather: every collective
# has a fixed cost, but the gather's traffic and host work grow with the group. On gloo
# the gather stayed ahead well past this size (docs/scaling.md).
GATHER_LIMIT = 200_000


class SyncedParts(NamedTuple):
    """What the sync stage reads of a tracker: its records of the step (folded), its
    table of states, its plan (where the per-group ``GroupSync`` is kept) and its kinds
    by name."""

    metric_records: Mapping[str, MetricRecords]
    table: StateTable
    plan: StepPlan
    kind_of: KindOf


def agree_schema(
    parts: SyncedParts, group: Any, device: torch.device, timeout: timedelta | None
) -> BufferLayout:
    """The union of every rank's metrics, agreed over ``group`` with one exchange of
    schemas (``rlmetrics._engine.schema``).

    Raises:
        ValueError: on every rank, when ranks disagree (``schema.agreed_layout``).
    """
    payload = schema_payload(parts.metric_records, parts.kind_of)
    return agreed_layout(parts.kind_of, gather_bytes(payload, group, device, timeout))


@dataclass(eq=False)
class GroupSync:
    """What a tracker keeps per process group between steps (in its ``StepPlan``): the
    group's ``GroupLayouts`` (the same on every rank), the device collectives run on,
    the host buffer a CPU gather writes into, and the packings of the recent sets of
    metrics.

    A packing is reused by ``StepPlan``'s rule (the same metric records, rows not
    renumbered; the recent sets' kept) while its layout is still the one the step
    picks (``GroupLayouts.newest_fitting``) and the group's padded sizes are the same
    object.
    """

    agreed: GroupLayouts
    device: torch.device
    world: int
    gathered: np.ndarray | None = None  # (world size, packed length), CPU groups only
    rows: list[Tensor] = field(default_factory=list)  # views of ``gathered``'s rows
    packings: RecentEntries[Packing] = field(default_factory=RecentEntries)
    own: dict[float, BufferLayout] = field(default_factory=dict)  # by digest, its agreements
    following: Packing | None = None  # an empty step's buffer, in no layout
    followed: Packing | None = None  # an empty step's packing of the layout it followed

    def packing_for(self, metric_records: Mapping[str, Any], table: StateTable) -> Packing:
        """How this rank packs this step: its metric records in the newest recent layout
        that holds their names, the group's padded sizes, and at the MAX part's end per
        placement whether this rank logged it and the tail (that layout's digest). A
        step whose names no recent layout holds packs an empty buffer with "changed"
        set, so every rank agrees again. A step that logged nothing packs
        ``following``'s buffer, which fits any layout its peers pick."""
        if not metric_records:
            return self._follower(table)
        current = list(metric_records.values())
        packing, agreed = self.packings.get(current), self.agreed
        sizes = agreed.sizes
        if packing is not None and packing.sizes is not sizes:
            packing = None  # made for other padding: its layout may have dropped
        known = None if packing is None else packing.layout
        layout = agreed.newest_fitting(metric_records, known, self.own)
        if packing is not None and packing.layout is layout:
            return packing
        tail = [1.0, 0.0, 0.0] if layout is None else [0.0, layout.digest, -layout.digest]
        fits, layout = layout is not None, layout or _NO_LAYOUT
        metrics = in_order(metric_records if fits else {}, layout)
        end = np.zeros(sizes.maxes - layout.num_maxes)
        # per placement, whether this rank logged the name
        end[: len(metrics)] = [records is not None for records in metrics]
        end[-TAIL:] = tail
        packing = Packing.make(layout, metrics, table, sizes.sums, end)
        packing.sizes, packing.logged_all = sizes, fits and None not in metrics
        if fits:
            self.packings.put(current, packing)
        return packing

    def agreed_on(self, layout: BufferLayout) -> None:
        """Record a layout every rank just agreed on (the union this tracker computed,
        with its kind objects): the group's newest, and this tracker's copy of it."""
        self.agreed.use(layout)
        recent = {known.digest for known in self.agreed.layouts}
        self.own = {d: mine for d, mine in self.own.items() if d in recent}
        self.own[layout.digest] = layout

    def _follower(self, table: StateTable) -> Packing:
        """An empty step's packing: every slot its merge's identity (0 in the SUM part,
        -inf in the whole MAX part, logged marks included) and the tail ``[0, -inf,
        -inf]``. Whatever layout the peers packed, this buffer leaves their reduced
        values as they are, and the reduced tail still carries their digest (all -inf:
        no rank logged anything)."""
        sizes = self.agreed.sizes
        packing = self.following
        if packing is None or packing.sizes is not sizes:
            end = np.full(sizes.maxes, -math.inf)
            end[-TAIL:] = [0.0, -math.inf, -math.inf]
            packing = self.following = Packing.make(_NO_LAYOUT, [], table, sizes.sums, end)
            packing.sizes, packing.logged_all = sizes, False
        return packing

    def follow(self, digest: float, table: StateTable) -> Packing:
        """What an empty step unpacks with: a packing of the layout the peers reduced
        the step in (the one with ``digest``), with nothing logged here."""
        layout = self.own.get(digest) or self.agreed.with_digest(digest)
        packing = self.followed
        if packing is None or packing.layout is not layout:
            none: list[MetricRecords | None] = [None] * len(layout.names)
            packing = self.followed = Packing.make(layout, none, table)
            packing.logged_all = False
        return packing

    def gather_rows(self, world: int, length: int) -> tuple[np.ndarray, list[Tensor]]:
        """The reusable (world, length) host buffer and its rows as CPU tensors."""
        if self.gathered is None or self.gathered.shape != (world, length):
            self.gathered = np.empty((world, length))
            self.rows = [torch.from_numpy(row) for row in self.gathered]
        return self.gathered, self.rows

    def forget_packing(self) -> None:
        """Drop the packings (the table's rows were renumbered); the group's layouts
        stay, since they name metrics, not rows."""
        self.packings.clear()
        self.following = self.followed = None


_NO_LAYOUT = BufferLayout([])  # what a step no recent layout holds packs, and an empty one

# Per process group, the layouts agreed over it (keyed by the group object, weakly):
# the same on every rank of the group, unlike each tracker's own cache.
_GROUP_LAYOUTS: weakref.WeakKeyDictionary[Any, GroupLayouts] = weakref.WeakKeyDictionary()


def _group_sync(parts: SyncedParts, group: Any, wait: timedelta | None) -> GroupSync:
    """The tracker's sync state for ``group`` (kept in its ``StepPlan``); on the
    group's first sync in this process (so on every rank's), the schema agreed first."""
    cache = parts.plan.group_syncs
    sync = cache.get(group)
    if isinstance(sync, GroupSync):
        return sync
    device = comm_device(group)
    agreed = _GROUP_LAYOUTS.get(group)
    first = None
    if agreed is None:  # no tracker synced over this group yet, on any rank
        agreed = _GROUP_LAYOUTS[group] = GroupLayouts()
        first = agree_schema(parts, group, device, wait)
    # else the step itself tells whether every rank picked the same recent layout
    sync = cache[group] = GroupSync(agreed, device, dist.get_world_size(group))
    if first is not None:
        sync.agreed_on(first)
    return sync


def sync_reduce(
    parts: SyncedParts, *, group: Any = None, timeout: float | timedelta | None = None
) -> ReducedStep:
    """A tracker's step (its ``parts``, folded) merged over ``group`` (every rank gets
    the same).

    Names in the cached layout that no rank logged this step are left out of the
    result, as a single process would leave them out.
    """
    pg = resolve_group(group)
    wait = as_timeout(timeout)
    sync = _group_sync(parts, pg, wait)
    metric_records, table = parts.metric_records, parts.table
    parts.plan.valid_for(table)
    for _ in range(2):
        packing = sync.packing_for(metric_records, table)
        sums, maxes = _reduce(packing, table, sync, pg, wait)
        changed, high, neg_low = maxes[-TAIL:].tolist()
        if high == -math.inf:  # every rank's step was empty
            return unpack(packing, table, sums[:0], maxes[:0], sync.device)
        if changed == 0 and high == -neg_low:  # every rank that logged packed one layout
            if packing is sync.following:
                packing = sync.follow(high, table)
            layout = packing.layout
            sync.agreed.use(layout)  # every rank packed this layout
            size = layout.num_maxes
            # when this rank logged every name, so did the group
            logged = None if packing.logged_all else maxes[size : size + len(layout.placements)]
            sums, maxes = sums[: layout.num_sums], maxes[:size]
            gather = partial(_gather_extras, group=pg, device=sync.device, wait=wait)
            return unpack(packing, table, sums, maxes, sync.device, logged, gather)
        sync.agreed_on(agree_schema(parts, pg, sync.device, wait))  # the newest: it fits
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
