"""Partition-invariance checks for users' own loss and metric code.

``assert_partition_invariant(fn, batch)`` runs ``fn(piece, tracker)`` over many splits
of ``batch`` (micro-batch sizes, token budgets, simulated data-parallel ranks, empty
pieces, a shuffled order, repeated epochs) and checks that every metric equals the
whole-batch run. Simulated ranks log into their own Trackers, merged through
``state()`` as ranks or Ray workers are; no process group is needed.

Pieces are ``Piece`` dicts: the batch's tensors for the piece's rows, plus ``.info``
(``PieceInfo``: rank, micro-batch index, epoch, ...) and ``.counts``: the whole
mini-batch's ``BatchCounts`` (global tokens and sequences, ``grad_scale`` = number of
simulated ranks) to pass to ``rlmetrics.rl`` losses as ``counts=piece.counts``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlmetrics.rl.counts import BatchCounts, local_counts
from rlmetrics.tracker import Tracker

MASK_KEYS = ("response_mask", "mask")
OPTIONS = ("mask_key", "token_budgets", "epochs", "empty_pieces", "shuffle", "seed", "tracker")
Split = list[list[np.ndarray]]  # per rank, per micro-batch: row indices


@dataclass(frozen=True)
class PieceInfo:
    """Where a piece sits in its run.

    Attributes:
        partition: the run's label, e.g. "ranks=2 micro_batch_size=3".
        rank, num_ranks: the simulated data-parallel rank.
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
            (keyword arguments of each ``Tracker``).

    Returns:
        The whole-batch metrics (one piece, one rank, one epoch).

    Raises:
        AssertionError: with a table of the drifting metrics.

    TODO: with a process group initialised, also run across the real ranks and compare
    ``compute(group=...)`` with the local whole-batch run.
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"assert_partition_invariant: unknown options {unknown}; known {OPTIONS}")
    size = _batch_size(batch)
    mask_key = options.get("mask_key", next((k for k in MASK_KEYS if k in batch), None))
    mask = None if mask_key is None else batch[mask_key]
    tracker_options = dict(options.get("tracker", {}))
    whole = [[np.arange(size)]]
    expected = _run(fn, batch, whole, "whole batch", mask, 1, tracker_options)
    drifts: dict[str, list[tuple]] = {}
    for label, split in _splits(size, mask, ranks, micro_batch_sizes, options):
        for epochs in options.get("epochs", (1,)):
            run_label = label if epochs == 1 else f"{label} epochs={epochs}"
            got = _run(fn, batch, split, run_label, mask, epochs, tracker_options)
            for name, row in _compare(expected, got, rtol, atol):
                drifts.setdefault(name, []).append((run_label, *row))
    if drifts:
        raise AssertionError(_table(drifts))
    return expected


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
    fn: Callable, batch: Mapping, split: Split, label: str, mask: Tensor | None, epochs: int,
    tracker_options: dict,
) -> dict[str, float]:  # fmt: skip
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
    size: int, mask: Tensor | None, ranks: Sequence[int], sizes: Sequence[int] | None,
    options: Mapping[str, Any],
) -> Iterator[tuple[str, Split]]:  # fmt: skip
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
        if not diff <= atol + rtol * abs(want):
            rel = diff / abs(want) if want else math.inf
            yield name, (want, have, diff, rel)


def _table(drifts: Mapping[str, list[tuple]]) -> str:
    header = ("metric", "runs", "worst run", "expected", "got", "abs diff", "rel diff")
    rows = [header]
    for name in sorted(drifts):
        runs = drifts[name]
        label, want, have, diff, rel = max(runs, key=lambda r: (_key(r[4]), _key(r[3])))
        rows.append(
            (name, str(len(runs)), label, _fmt(want, "absent"), _fmt(have, "missing"),
             f"{diff:.3g}", f"{rel:.3g}")
        )  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return f"{len(drifts)} metric(s) depend on the partition:\n" + "\n".join(lines)


def _key(x: float) -> float:
    return -1.0 if math.isnan(x) else x


def _fmt(value: float | None, absent: str) -> str:
    return absent if value is None else f"{value:.12g}"
