"""Tracker sync over torch.distributed: schema agreement and packed collectives.

Every scalar metric's state packs into a SUM buffer (additive slots) and a MAX buffer
(max slots; minima are stored negated). A steady-state step reduces both with one
collective, however many scalar metrics exist: an ``all_gather`` of the two buffers
concatenated, reduced on the host (rows added in rank order, so every rank gets the
same bits; max over rows). Above ``GATHER_LIMIT`` gathered floats (many ranks times a
large layout) the gather's traffic grows with the group, and the step issues
``all_reduce(SUM)`` and ``all_reduce(MAX)`` instead. The MAX buffer also carries a
"schema changed" flag and the layout's hash, so ranks notice without an extra
collective when some rank logged a name the cached schema lacks; only then do they
agree again (one byte gather) and repeat the reduce. Kinds with an extra payload (std,
dist) add one ``all_gather``.

Nothing here unpickles data that did not come from a rank of the same process group:
schemas travel as JSON, extras of built-in kinds as float64 tensors; only user kinds
whose extras cannot be packed travel pickled, and only between the group's ranks.

Timeouts: every collective is issued with ``async_op=True`` and waited on with the
timeout, so a rank that died or never arrives raises ``SyncTimeoutError`` on the others
(with gloo; with NCCL the host wait is bounded by the process group's own timeout and
watchdog, set through ``init_process_group(timeout=...)``).

Replicas: merge over the data-parallel group only. Tensor- or pipeline-parallel copies
of a DP rank log the same values; each computes over its own DP group and gets the same
result, so nothing is counted twice. To compute over a group that contains replicas,
log only on one copy (see ``is_replica_source``).
"""

from __future__ import annotations

import json
import pickle
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from rlmetrics.layout import Layout
from rlmetrics.packing import (
    SendBuffer,
    extra_sizes,
    in_order,
    pack_extras,
    pack_scalars,
    restore_nans,
    sum_part,
    unpack,
)
from rlmetrics.reduced import Reduced, python_results

HEADER = 3  # MAX-buffer tail: [logged per slot..., schema changed, layout hash, -layout hash]

# Up to this many gathered floats per step (ranks x (SUM + MAX buffer sizes)), the two
# buffers are reduced by one all_gather and a host reduction; above it, by
# all_reduce(SUM) + all_reduce(MAX). Every collective has a fixed cost; the gather's
# traffic and host work grow with ranks x size. Measured on gloo (2 and 4 ranks on
# 127.0.0.1, one thread each): from 200 to 24,000 gathered floats the gather took half
# the process CPU time of the pair or less, and under half its wall time; it was still
# ahead at 240,000 gathered floats and behind at 800,000 (the list all_gather, which
# gloo supports in every torch we support, copies each row once more). 200,000 (1.6 MB
# per rank) stays below that crossover; a few hundred metrics need a few thousand.
GATHER_LIMIT = 200_000


class SyncTimeoutError(RuntimeError):
    """A collective did not complete within the timeout (a rank died or hangs)."""


def should_sync(group: Any) -> bool:
    """Whether ``compute()`` merges over a process group."""
    if group is not None:
        return True
    return dist.is_available() and dist.is_initialized()


def resolve_group(group: Any) -> Any:
    """A ProcessGroup from None (the default group), a group, or (DeviceMesh, dim)."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
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
    return group


def is_initialized() -> bool:
    """Whether torch.distributed is available and initialised in this process."""
    return dist.is_available() and dist.is_initialized()


def rank_in(group: Any) -> int:
    """This process's rank in ``group`` (-1 when it is not a member)."""
    return dist.get_rank(group)


def all_reduce_max(tensor: Tensor, group: Any, timeout: float | timedelta | None = None) -> Tensor:
    """Max ``tensor`` in place over ``group`` (raises SyncTimeoutError rather than hang)."""
    all_reduce(tensor, dist.ReduceOp.MAX, group, _timeout(timeout), "all_reduce(MAX)")
    return tensor


def world_size(group: Any = None) -> int:
    """The size of ``group`` (default: the world); 1 when torch.distributed is not
    initialised, so single-process code takes the same path."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(resolve_group(group))


def all_reduce_sum(
    tensor: Tensor, group: Any = None, timeout: float | timedelta | None = None
) -> Tensor:
    """Sum ``tensor`` in place over ``group`` (a no-op on one process); returns it."""
    if world_size(group) > 1:
        all_reduce(
            tensor, dist.ReduceOp.SUM, resolve_group(group), _timeout(timeout), "all_reduce(SUM)"
        )
    return tensor


def is_replica_source(mesh: Any, replica_dims: tuple[str, ...]) -> bool:
    """True on the one copy (local rank 0 in every ``replica_dims``) that should log
    when metrics are merged over a group containing tensor/pipeline-parallel replicas."""
    return all(mesh.get_local_rank(dim) == 0 for dim in replica_dims)


def comm_device(group: Any) -> torch.device:
    """The device collectives of ``group`` run on: CUDA for NCCL, else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _timeout(timeout: float | timedelta | None) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    return timedelta(seconds=float(timeout))


def _wait(work: Any, timeout: timedelta | None, what: str) -> None:
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
    _wait(dist.all_reduce(tensor, op=op, group=group, async_op=True), timeout, what)


def all_gather(tensor: Tensor, group: Any, timeout: timedelta | None, what: str) -> list[Tensor]:
    """All ranks' equal-sized ``tensor``s, in rank order."""
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    _wait(dist.all_gather(out, tensor, group=group, async_op=True), timeout, what)
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


def agree_schema(
    tracker: Any, group: Any, device: torch.device, timeout: timedelta | None
) -> Layout:
    """The union of every rank's (name, kind) pairs.

    Raises:
        ValueError: on every rank, when ranks log a name with two kinds, or with one
            kind configured two ways (a histogram with other edges).
    """
    local = sorted(
        (name, acc.kind.name, acc.kind.fingerprint()) for name, acc in tracker.accumulators.items()
    )
    payloads = gather_bytes(json.dumps(local).encode(), group, device, timeout)
    union: dict[str, tuple[str, str, int]] = {}
    conflicts: list[str] = []
    for rank, payload in enumerate(payloads):
        for name, kind_name, fingerprint in json.loads(payload):
            seen_kind, seen_fingerprint, seen_rank = union.setdefault(
                name, (kind_name, fingerprint, rank)
            )
            if seen_kind != kind_name:
                conflicts.append(
                    f"metric {name!r} is kind {seen_kind!r} on rank {seen_rank} "
                    f"but kind {kind_name!r} on rank {rank}"
                )
            elif seen_fingerprint != fingerprint:
                conflicts.append(
                    f"metric {name!r} has kind {kind_name!r} configured as {seen_fingerprint!r} "
                    f"on rank {seen_rank} but as {fingerprint!r} on rank {rank}"
                )
    if conflicts:
        raise ValueError("ranks disagree on metric kinds: " + "; ".join(conflicts))
    return Layout([(name, tracker.kind(kind_name)) for name, (kind_name, _, _) in union.items()])


def _logged(accumulators: Mapping[str, Any], layout: Layout, fits: bool) -> list[float]:
    """Per layout slot, 1.0 when this process logged the name this step, else 0.0."""
    if not fits:
        return [0.0] * len(layout.slots)
    if len(accumulators) == len(layout.slots):
        return [1.0] * len(layout.slots)
    return [1.0 if name in accumulators else 0.0 for name in layout.names]


@dataclass(eq=False)
class _Plan:
    """How this rank packs a step: its accumulators in layout order (blanks included),
    the MAX tail, and the send buffer of steps of python numbers only."""

    layout: Layout
    accs: list[Any]
    tail: np.ndarray
    logged_all: bool  # this rank logged every name of the layout
    send: SendBuffer | None = None


@dataclass(eq=False)
class _GroupSync:
    """What a tracker keeps per process group between steps: the agreed layout, the
    device collectives run on, the host buffer a CPU gather writes into, and the last
    step's packing plan.

    The plan is reused when a step's accumulators are the same objects, in the same
    order, as the last one's: a Tracker keeps each name's accumulator across steps
    (while its kind stays) and never files one object under two names, so the same
    objects mean the same names and kinds, and the layout still fits.
    """

    layout: Layout
    device: torch.device
    world: int
    gathered: np.ndarray | None = None  # (world size, packed length), CPU groups only
    rows: list[Tensor] = field(default_factory=list)  # views of ``gathered``'s rows
    seen: list[Any] = field(default_factory=list)  # the last plan's accumulators, dict order
    plan: _Plan | None = None

    def packing_plan(self, accumulators: Mapping[str, Any]) -> _Plan:
        """This step's accumulators in layout order, and the MAX buffer's tail: [logged
        per slot..., schema changed, hash, -hash]. A step that logged a name the layout
        lacks packs as empty with "changed" set, so every rank agrees again."""
        layout = self.layout
        current = list(accumulators.values())
        plan = self.plan
        if plan is not None and plan.layout is layout and current == self.seen:  # identity
            return plan
        fits = layout.fits(accumulators)
        logged = _logged(accumulators, layout, fits)
        tail = np.array([*logged, 0.0 if fits else 1.0, layout.digest, -layout.digest])
        accs = in_order(accumulators if fits else {}, layout)
        plan = _Plan(layout, accs, tail, fits and len(accumulators) == len(layout.slots))
        if fits:
            self.seen, self.plan = current, plan
        return plan

    def gather_rows(self, world: int, length: int) -> tuple[np.ndarray, list[Tensor]]:
        """The reusable (world, length) host buffer and its rows as CPU tensors."""
        if self.gathered is None or self.gathered.shape != (world, length):
            self.gathered = np.empty((world, length))
            self.rows = [torch.from_numpy(row) for row in self.gathered]
        return self.gathered, self.rows


def sync_reduce(
    tracker: Any, *, group: Any = None, timeout: float | timedelta | None = None
) -> Reduced:
    """The tracker's step merged over ``group`` (every rank gets the same).

    Names in the cached layout that no rank logged this step are left out of the
    result, as a single process would leave them out.
    """
    pg = resolve_group(group)
    wait = _timeout(timeout)
    cache = tracker.sync_cache
    if not isinstance(cache, weakref.WeakKeyDictionary):
        cache = tracker.sync_cache = weakref.WeakKeyDictionary()
    # keyed by the group object (weakly), never by id(): a group created after another
    # was destroyed may reuse its id on some ranks only, which would send those ranks
    # straight to the reduce with a stale layout while the others agree again
    sync = cache.get(pg)
    if sync is None:
        device = comm_device(pg)
        layout = agree_schema(tracker, pg, device, wait)
        sync = cache[pg] = _GroupSync(layout, device, dist.get_world_size(pg))
    accumulators = tracker.accumulators
    for _ in range(2):
        layout = sync.layout
        plan = sync.packing_plan(accumulators)
        sums, maxes = _reduce(plan, sync, pg, wait)
        if python_results(layout):  # read the buffers as lists once, for the results
            sums_list, maxes_list = sums.tolist(), maxes.tolist()
            changed, high, neg_low = maxes_list[-HEADER:]
        else:
            sums_list = maxes_list = None
            changed, high, neg_low = maxes[-HEADER:].tolist()
        if changed == 0 and high == -neg_low:
            size = layout.num_maxes
            if sums_list is not None and _plain(plan, sums_list):
                scalars = (sums_list, maxes_list[:size])
                return Reduced(
                    layout, sums, maxes[:size], {}, keep=None, counted=False, scalars=scalars
                )
            # when this rank logged every name, so did the group
            logged = None if plan.logged_all else maxes[size : size + len(layout.slots)]
            return _finish(accumulators, layout, sums, maxes[:size], logged, pg, sync, wait)
        sync.layout = agree_schema(tracker, pg, sync.device, wait)
    raise RuntimeError("rlmetrics sync: ranks did not settle on a schema after re-agreeing")


def _plain(plan: _Plan, sums: list[float]) -> bool:
    """Whether a reduced step is the plain kind: every name logged on this rank (so in
    the group), no framework counts to report, no extras."""
    layout = plan.layout
    return plan.logged_all and not layout.extra_slots and not any(sums[layout.num_kind_sums :])


def _reduce(
    plan: _Plan, sync: _GroupSync, group: Any, wait: timedelta | None
) -> tuple[np.ndarray, np.ndarray]:
    """The packed SUM part and MAX part (tail included) reduced over ``group``, on the
    host (one device-to-host copy): one gather up to ``GATHER_LIMIT`` gathered floats,
    else two all_reduces."""
    world, layout, accs, tail = sync.world, plan.layout, plan.accs, plan.tail
    num_sums = layout.num_sums
    if world * (num_sums + layout.num_maxes + len(tail)) <= GATHER_LIMIT:
        if plan.send is None and not layout.extra_slots:
            plan.send = SendBuffer.make(layout, tail)
        packed = pack_scalars(accs, layout, sync.device, max_tail=tail, reuse=plan.send)
        what = "all_gather of metric states"
        if packed.device.type == "cpu":  # straight into a reused host buffer
            gathered, rows = sync.gather_rows(world, packed.numel())
            _wait(dist.all_gather(rows, packed, group=group, async_op=True), wait, what)
        else:
            gathered = torch.stack(all_gather(packed, group, wait, what)).cpu().numpy()
        return _add_rows(gathered[:, :num_sums]), _max_rows(gathered[:, num_sums:])
    packed = pack_scalars(accs, layout, sync.device, max_tail=tail, nan_counts=True)
    additive = sum_part(layout, nan_counts=True)
    all_reduce(
        packed[:additive], dist.ReduceOp.SUM, group, wait, "all_reduce(SUM) of metric states"
    )
    all_reduce(
        packed[additive:], dist.ReduceOp.MAX, group, wait, "all_reduce(MAX) of metric states"
    )
    host = packed.cpu().numpy()
    sums = host[:additive]
    return sums[:num_sums], restore_nans(sums, host[additive:], layout)


def _add_rows(rows: np.ndarray) -> np.ndarray:
    """The rows added in rank order, so every rank gets the same bits."""
    total = rows[0] + rows[1] if len(rows) > 1 else rows[0].copy()
    for row in rows[2:]:
        total += row
    return total


def _max_rows(rows: np.ndarray) -> np.ndarray:
    """The rows' elementwise max (NaN wins, as in a single process)."""
    top = np.maximum(rows[0], rows[1]) if len(rows) > 1 else rows[0].copy()
    for row in rows[2:]:
        np.maximum(top, row, out=top)
    return top


def _finish(
    accumulators: Mapping[str, Any],
    layout: Layout,
    sums: np.ndarray,
    maxes: np.ndarray,
    logged: np.ndarray,
    group: Any,
    sync: _GroupSync,
    wait: timedelta | None,
) -> Reduced:
    """Gather the extras (when any) and unpack the reduced buffers (``maxes`` without
    the tail)."""
    sizes = extra_sizes(layout, maxes)
    extras: list[np.ndarray] = []
    objects: list[Mapping[str, object]] = []
    if layout.extra_slots:
        device = sync.device
        vector, local_objects = pack_extras(accumulators, layout, sizes, device)
        if vector.numel():
            rows = all_gather(vector, group, wait, "extras gather")
            extras = list(torch.stack(rows).cpu().numpy())  # one device-to-host copy
        if local_objects:
            payloads = gather_bytes(pickle.dumps(local_objects), group, device, wait)
            objects = [pickle.loads(p) for p in payloads]  # only from this group's ranks
    return unpack(layout, sums, maxes, extras, objects, sizes, logged)
