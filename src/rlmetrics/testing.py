"""Partition-invariance checks for users' own loss and metric code.

``assert_partition_invariant(fn, batch)`` runs ``fn(piece, tracker)`` over many splits
of ``batch`` (micro-batch sizes, token budgets, simulated data-parallel ranks, empty
pieces, a shuffled order, repeated epochs) and checks that every metric equals the
whole-batch run. Simulated ranks log into their own Trackers, merged through
``state()`` as ranks or Ray workers are; no process group is needed. When one is
initialised (or ``group=`` is passed), every rank of the group also runs its own shard
of the batch and merges with ``Tracker.compute(group=...)``: the real collective.
``partition_runs(fn, batch)`` returns every simulated run's metrics without comparing
them (what ``rlmetrics audit --fn`` reports).

Pieces are ``Piece`` dicts: the batch's tensors for the piece's rows, plus ``.info``
(``PieceInfo``: rank, micro-batch index, epoch, ...) and ``.counts``: the whole
mini-batch's ``BatchCounts`` (global tokens and sequences, ``grad_scale`` = number of
simulated or real ranks) to pass to ``rlmetrics.rl`` losses as ``counts=piece.counts``.
"""

from __future__ import annotations

import hashlib
import math
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlmetrics.distributed import (
    gather_bytes,
    is_initialized,
    process_group,
    rank_in,
    world_size,
)
from rlmetrics.rl.counts import BatchCounts, local_counts
from rlmetrics.tracker import Tracker

MASK_KEYS = ("response_mask", "mask")
OPTIONS = (
    "mask_key",
    "token_budgets",
    "epochs",
    "empty_pieces",
    "shuffle",
    "seed",
    "tracker",
    "group",
    "real_ranks",
)
REAL = "real "  # the label prefix of runs across real ranks
Split = list[list[np.ndarray]]  # per rank, per micro-batch: row indices


@dataclass(frozen=True)
class PieceInfo:
    """Where a piece sits in its run.

    Attributes:
        partition: the run's label, e.g. "ranks=2 micro_batch_size=3"; runs across
            real ranks start with "real ", e.g. "real ranks=2 micro_batch_size=3".
        rank, num_ranks: the simulated data-parallel rank, or the real rank in the
            group (and the group's size) for "real " runs.
        epoch: the pass over the data (0-based).
        index, num_pieces: the micro-batch's position on its rank in this epoch.
        rows: the piece's row indices in ``batch``.
        counts: the whole batch's global counts (None when the batch has no mask).
    """

    partition: str
    rank: int
    num_ranks: int
    epoch: int
    index: int
    num_pieces: int
    rows: np.ndarray
    counts: BatchCounts | None

    @property
    def is_last(self) -> bool:
        """The last micro-batch of this rank's optimizer step (accumulation boundary)."""
        return self.index == self.num_pieces - 1


class Piece(dict):
    """A piece of the batch: ``piece[key]`` tensors plus ``.info`` and ``.counts``."""

    def __init__(self, tensors: Mapping[str, Tensor], info: PieceInfo) -> None:
        super().__init__(tensors)
        self.info = info

    @property
    def counts(self) -> BatchCounts | None:
        """The mini-batch's global counts, for ``rlmetrics.rl`` losses."""
        return self.info.counts


def assert_partition_invariant(
    fn: Callable[[Piece, Tracker], Any],
    batch: Mapping[str, Tensor],
    *,
    ranks: Sequence[int] = (1, 2, 4),
    micro_batch_sizes: Sequence[int] | None = None,
    rtol: float = 1e-9,
    atol: float = 0.0,
    **options: Any,
) -> dict[str, float]:
    """Check that ``fn``'s metrics do not depend on how ``batch`` is split.

    Without a process group, everything runs in this process: simulated ranks log into
    their own Trackers, merged through ``state()``.

    With torch.distributed initialised (or ``group=`` passed), the check also runs
    across the group's real ranks. Every rank of the group must call it, with the same
    ``fn`` and the same whole ``batch``. Each rank runs the simulated checks, then takes
    its contiguous shard of the batch (``np.array_split``: uneven shards, empty ones
    when the batch has fewer rows than the group has ranks), runs ``fn`` over it in the
    same micro-batch sizes, token budgets, empty pieces and shuffled order as a
    simulated run with that many ranks (labels "real ranks=N ..."; ``piece.info.rank``
    is the real rank), merges with ``Tracker.compute(group=...)`` and compares with its
    own whole-batch run. Ranks then exchange their reports, so a drift on any rank
    raises on every rank and no rank is left waiting in a collective; an exception
    raised by ``fn`` on one rank is re-raised there and reported on the others.

    Args:
        fn: ``fn(piece, tracker)`` logs the metrics of one piece. It may keep state per
            ``(piece.info.partition, piece.info.rank)``; it must not share state across
            simulated ranks that real ranks would not share.
        batch: tensors sharing their first dimension (use float64 for tight tolerances).
        ranks: simulated data-parallel sizes (rows split into contiguous shares).
        micro_batch_sizes: rows per micro-batch (default 1, 2, 3 and the whole share).
        rtol, atol: a metric drifts when |got - expected| > atol + rtol·|expected|.
        **options: ``mask_key`` (default "response_mask" or "mask" when present; None:
            no token budgets or counts), ``token_budgets`` (tokens per micro-batch;
            default the longest sequence and twice it), ``epochs`` (default (1,); pass
            (1, 2) when every metric is a per-step mean), ``empty_pieces`` (True),
            ``shuffle`` (True: one run on permuted rows), ``seed`` (0), ``tracker``
            (keyword arguments of each ``Tracker``), ``group`` (the process group of
            the real ranks: a ProcessGroup or a (DeviceMesh, dim name) pair; default
            the world when torch.distributed is initialised), ``real_ranks`` (None:
            check across real ranks when a group is initialised or passed; False:
            never, even then; True: always, raising when there is no group).

    Returns:
        The whole-batch metrics (one piece, one rank, one epoch).

    Raises:
        AssertionError: with a table of the drifting metrics (on every rank of the
            group in the real-rank mode).
        ValueError: ``real_ranks=True`` without a process group, or (on every rank)
            ranks passed different batches or options.
        RuntimeError: on the other ranks, when ``fn`` raised on some rank.
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"assert_partition_invariant: unknown options {unknown}; known {OPTIONS}")
    _batch_size(batch)
    group = _real_group(options)
    mask = _mask(batch, options)
    expected: dict[str, float] | None = None
    drifts: dict[str, list[tuple]] = {}
    error: BaseException | None = None
    try:
        for run_label, got in _iter_runs(fn, batch, ranks, micro_batch_sizes, mask, options):
            if expected is None:
                expected = got  # the first run: the whole batch
                continue
            for name, row in _compare(expected, got, rtol, atol):
                drifts.setdefault(name, []).append((run_label, *row))
    except Exception as err:
        if group is None:
            raise
        error = err  # raised after the real-rank runs, which every rank must join
    if group is not None:
        error = _check_real_ranks(
            fn,
            batch,
            group,
            mask,
            expected,
            drifts,
            error,
            micro_batch_sizes,
            rtol,
            atol,
            options,
        )
    if error is not None:
        raise error
    if drifts:
        raise AssertionError(_table(drifts))
    assert expected is not None
    return expected


def partition_runs(
    fn: Callable[[Piece, Tracker], Any],
    batch: Mapping[str, Tensor],
    *,
    ranks: Sequence[int] = (1, 2, 4),
    micro_batch_sizes: Sequence[int] | None = None,
    **options: Any,
) -> dict[str, dict[str, float]]:
    """Every run of ``assert_partition_invariant``'s simulated check: {label: metrics}.

    The first entry is the reference, "whole batch" (one piece, one rank, one epoch);
    then one entry per split, in the checker's order, labelled as ``piece.info.partition``
    (e.g. "ranks=2 micro_batch_size=3", "ranks=4 token_budget=12 epochs=2"). Takes the
    checker's arguments and options except ``group`` and ``real_ranks`` (no process
    group is used) and compares nothing: ``rlmetrics audit --fn`` reports the spreads.
    """
    known = set(OPTIONS) - {"group", "real_ranks"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"partition_runs: unknown options {unknown}; known {sorted(known)}")
    _batch_size(batch)
    runs: dict[str, dict[str, float]] = {}
    for label, got in _iter_runs(
        fn, batch, ranks, micro_batch_sizes, _mask(batch, options), options
    ):
        runs.setdefault(label, got)  # repeated ranks or budgets: the same split again
    return runs


def _mask(batch: Mapping[str, Tensor], options: Mapping[str, Any]) -> Tensor | None:
    """The mask of token budgets and counts (``mask_key``, else the first of MASK_KEYS)."""
    mask_key = options.get("mask_key", next((k for k in MASK_KEYS if k in batch), None))
    return None if mask_key is None else batch[mask_key]


def _iter_runs(
    fn: Callable,
    batch: Mapping[str, Tensor],
    ranks: Sequence[int],
    sizes: Sequence[int] | None,
    mask: Tensor | None,
    options: Mapping[str, Any],
) -> Iterator[tuple[str, dict[str, float]]]:
    """(label, metrics) of the whole batch, then of every simulated split and epochs."""
    size = _batch_size(batch)
    tracker_options = dict(options.get("tracker", {}))
    whole = [[np.arange(size)]]
    yield "whole batch", _run(fn, batch, whole, "whole batch", mask, 1, tracker_options)
    for label, split in _splits(size, mask, ranks, sizes, options):
        for epochs in options.get("epochs", (1,)):
            run_label = label if epochs == 1 else f"{label} epochs={epochs}"
            yield run_label, _run(fn, batch, split, run_label, mask, epochs, tracker_options)


def _real_group(options: Mapping[str, Any]) -> Any:
    """The process group of the real-rank mode, or None to run simulated ranks only."""
    real = options.get("real_ranks")
    if real is not None and not isinstance(real, bool):
        raise TypeError(f"real_ranks must be None, True or False, got {real!r}")
    if real is False:
        return None
    group = options.get("group")
    if not is_initialized():
        if real or group is not None:
            raise ValueError(
                "assert_partition_invariant: the real-rank mode (real_ranks=True or group=...) "
                "needs torch.distributed to be initialised"
            )
        return None
    pg = process_group(group)
    if rank_in(pg) < 0:
        raise ValueError("assert_partition_invariant: this process is not in group")
    return pg


def _check_real_ranks(
    fn: Callable,
    batch: Mapping[str, Tensor],
    group: Any,
    mask: Tensor | None,
    expected: Mapping[str, float] | None,
    drifts: dict[str, list[tuple]],
    error: BaseException | None,
    sizes: Sequence[int] | None,
    rtol: float,
    atol: float,
    options: Mapping[str, Any],
) -> BaseException | None:
    """Run every rank's shard, merge over ``group``, compare with the whole batch.

    Adds the drifts to ``drifts``; returns the exception to raise (``error``, the first
    one ``fn`` or ``compute`` raised here, or another rank's failure), else None. Every
    rank issues the same collectives whatever fails, so none is left waiting.
    """
    rank, world = rank_in(group), world_size(group)
    size = _batch_size(batch)
    runs = [
        (REAL + (label if epochs == 1 else f"{label} epochs={epochs}"), split[rank], epochs)
        for label, split in _splits(size, mask, (world,), sizes, options)
        for epochs in options.get("epochs", (1,))
    ]
    _check_same_call(batch, runs, group)
    counts = None
    if mask is not None:
        total = local_counts(mask)
        counts = BatchCounts(total[0], total[1], float(world))
    tracker_options = dict(options.get("tracker", {}))
    for label, pieces, epochs in runs:
        tracker = Tracker(**tracker_options)
        if error is None:  # after a failure, join the collectives with an empty tracker
            try:
                for epoch in range(epochs):
                    for index, rows in enumerate(pieces):
                        info = PieceInfo(
                            label, rank, world, epoch, index, len(pieces), rows, counts
                        )
                        fn(_piece(batch, info), tracker)
            except Exception as err:
                error = err
                tracker.reset()
        try:
            got = tracker.compute(group=group)
        except Exception as err:  # the sync's errors (kind conflicts) are every rank's
            error = error or err
            continue
        if error is None and expected is not None:
            for name, row in _compare(expected, got, rtol, atol):
                drifts.setdefault(name, []).append((label, *row))
    if error is not None:  # "E": raised, "D": drifted, "P": passed (never empty bytes)
        trace = "".join(traceback.format_exception(error, limit=-3)).strip()
        report = f"E{type(error).__name__}: {error}\n{trace}"
    else:
        report = "D" + _table(drifts) if drifts else "P"
    reports = [r.decode() for r in gather_bytes(report.encode(), group)]
    failed = [r for r, text in enumerate(reports) if text != "P"]
    if error is not None or not failed:
        return error
    if drifts and all(text == report for text in reports):  # the same table everywhere
        return AssertionError(report[1:])
    crashed = [r for r in failed if reports[r].startswith("E")]
    shown = crashed or failed  # a crash makes the other ranks' merges drift: not shown
    texts = "\n".join(f"--- rank {r}:\n{reports[r][1:]}" for r in shown)
    if crashed:
        return RuntimeError(
            f"assert_partition_invariant: fn or compute raised on rank(s) {crashed}:\n{texts}"
        )
    return AssertionError(f"metrics depend on the partition on rank(s) {failed}:\n{texts}")


def _check_same_call(batch: Mapping[str, Tensor], runs: list, group: Any) -> None:
    """Raise ValueError on every rank unless all ranks passed the same batch and runs."""
    digest = hashlib.blake2b(digest_size=8)
    for key in sorted(batch):
        value = batch[key].detach().cpu().contiguous()
        digest.update(f"{key}|{value.dtype}|{tuple(value.shape)}|".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    digest.update(repr([(label, epochs) for label, _, epochs in runs]).encode())
    if len(set(gather_bytes(digest.digest(), group))) > 1:
        raise ValueError(
            "assert_partition_invariant: ranks passed different batches or options; every "
            "rank of the group must pass the same whole batch"
        )


def _piece(batch: Mapping[str, Tensor], info: PieceInfo) -> Piece:
    select = torch.as_tensor(info.rows, dtype=torch.long)
    return Piece({k: v[select.to(v.device)] for k, v in batch.items()}, info)


def _batch_size(batch: Mapping[str, Tensor]) -> int:
    if not isinstance(batch, Mapping) or not batch:
        raise TypeError("batch must be a non-empty dict of tensors")
    sizes = {}
    for key, value in batch.items():
        if not isinstance(value, Tensor) or value.dim() == 0:
            raise TypeError(f"batch[{key!r}] must be a tensor with a batch dimension")
        sizes[key] = value.shape[0]
    if len(set(sizes.values())) != 1:
        raise ValueError(f"batch tensors must share their first dimension, got {sizes}")
    return next(iter(sizes.values()))


def _run(
    fn: Callable,
    batch: Mapping,
    split: Split,
    label: str,
    mask: Tensor | None,
    epochs: int,
    tracker_options: dict,
) -> dict[str, float]:
    """Run ``fn`` over one split; merge the ranks' states; compute (no process group)."""
    counts = None
    if mask is not None:
        total = local_counts(mask)
        counts = BatchCounts(total[0], total[1], float(len(split)))
    states = []
    for rank, pieces in enumerate(split):
        tracker = Tracker(**tracker_options)
        for epoch in range(epochs):
            for index, rows in enumerate(pieces):
                info = PieceInfo(label, rank, len(split), epoch, index, len(pieces), rows, counts)
                select = torch.as_tensor(rows, dtype=torch.long)
                fn(Piece({k: v[select.to(v.device)] for k, v in batch.items()}, info), tracker)
        states.append(tracker.state())
    if len(split) == 1 and len(split[0]) == 1:  # the reference: no state round trip
        merged = tracker
    else:
        merged = Tracker(**tracker_options)
        for state in states:
            merged.merge(state)
    return merged.compute(sync=False)


def _splits(
    size: int,
    mask: Tensor | None,
    ranks: Sequence[int],
    sizes: Sequence[int] | None,
    options: Mapping[str, Any],
) -> Iterator[tuple[str, Split]]:
    """Every (label, split) to run."""
    rows = np.arange(size)
    sizes = sorted({s for s in (sizes or (1, 2, 3, size)) if 1 <= s <= max(size, 1)})
    tokens = None if mask is None else (mask != 0).sum(-1).cpu().numpy()
    budgets = options.get("token_budgets")
    if budgets is None and tokens is not None:
        longest = int(tokens.max()) if size else 1
        budgets = sorted({max(longest, 1), max(2 * longest, 1)})
    for num_ranks in ranks:
        shares = np.array_split(rows, num_ranks)
        for mbs in sizes:
            yield f"ranks={num_ranks} micro_batch_size={mbs}", [_chunks(s, mbs) for s in shares]
        if tokens is not None:  # no mask: no token budgets
            for budget in budgets or ():
                split = [_budget_chunks(s, tokens, budget) for s in shares]
                yield f"ranks={num_ranks} token_budget={budget}", split
        if options.get("empty_pieces", True):
            split = [_with_empties(_chunks(s, sizes[0])) for s in shares]
            yield f"ranks={num_ranks} micro_batch_size={sizes[0]} +empty pieces", split
    if options.get("shuffle", True) and size > 1:
        order = np.random.default_rng(options.get("seed", 0)).permutation(size)
        num_ranks = max(ranks)
        mbs = sizes[min(1, len(sizes) - 1)]
        split = [_chunks(s, mbs) for s in np.array_split(order, num_ranks)]
        yield f"shuffled ranks={num_ranks} micro_batch_size={mbs}", split


def _chunks(rows: np.ndarray, size: int) -> list[np.ndarray]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def _budget_chunks(rows: np.ndarray, tokens: np.ndarray, budget: int) -> list[np.ndarray]:
    """Greedy packing in order: a micro-batch holds at most ``budget`` tokens (a longer
    sequence goes alone)."""
    chunks: list[list[int]] = []
    used = budget + 1
    for row in rows:
        if used + tokens[row] > budget or not chunks:
            chunks.append([])
            used = 0
        chunks[-1].append(int(row))
        used += int(tokens[row])
    return [np.asarray(c, dtype=np.int64) for c in chunks]


def _with_empties(chunks: list[np.ndarray]) -> list[np.ndarray]:
    empty = np.zeros(0, dtype=np.int64)
    middle = len(chunks) // 2
    return [empty, *chunks[:middle], empty, *chunks[middle:], empty]


def _compare(
    expected: Mapping[str, float], got: Mapping[str, float], rtol: float, atol: float
) -> Iterator[tuple[str, tuple]]:
    for name in sorted(set(expected) | set(got)):
        want, have = expected.get(name), got.get(name)
        if want is None or have is None:
            yield name, (want, have, math.inf, math.inf)
            continue
        if (math.isnan(want) and math.isnan(have)) or want == have:
            continue
        diff = abs(have - want)
        # a non-finite value matches only itself (inf <= atol + rtol * inf would pass)
        if not (math.isfinite(want) and math.isfinite(have) and diff <= atol + rtol * abs(want)):
            rel = diff / abs(want) if want else math.inf
            yield name, (want, have, diff, rel)


def _table(drifts: Mapping[str, list[tuple]]) -> str:
    header = ("metric", "runs", "worst run", "expected", "got", "abs diff", "rel diff")
    rows = [header]
    for name in sorted(drifts):
        runs = drifts[name]
        label, want, have, diff, rel = max(runs, key=lambda r: (_key(r[4]), _key(r[3])))
        rows.append(
            (
                name,
                str(len(runs)),
                label,
                _fmt(want, "absent"),
                _fmt(have, "missing"),
                f"{diff:.3g}",
                f"{rel:.3g}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return f"{len(drifts)} metric(s) depend on the partition:\n" + "\n".join(lines)


def _key(x: float) -> float:
    return -1.0 if math.isnan(x) else x


def _fmt(value: float | None, absent: str) -> str:
    return absent if value is None else f"{value:.12g}"


__all__ = ["Piece", "PieceInfo", "assert_partition_invariant", "partition_runs"]
