"""The cost model of docs/scaling.md: one step's metric sync, per rank, as a function of
ranks R, metrics N and elements n.

Pure arithmetic (no torch): ``docs/scaling.md``'s tables are printed by running this
module, and ``benchmarks/scaling_bench.py`` compares its byte and collective counts with
what real gloo ranks send.

Collectives are modelled as the algorithms the backends run:

* gloo: ``all_gather`` and ``all_reduce`` are rings (gloo/allgather.cc, gloo/allreduce.cc
  with the default algorithm): an all_gather of b bytes per rank sends and receives
  (R-1)·b per rank in R-1 rounds; an all_reduce of B bytes sends and receives
  2(R-1)/R·B in 2(R-1) rounds. ``barrier`` is a dissemination barrier, ceil(log2 R)
  rounds. Each round is two messages (two chunks in flight).
* NCCL: ``all_gather`` is a ring (R-1 rounds; the PAT algorithm of NCCL >= 2.23 is
  logarithmic but only with one GPU per node); ``all_reduce`` of small buffers across
  nodes uses the tree, about 2·log2(R) rounds, the same bytes to within a factor 2.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

FLOAT = 8  # bytes: rlmetrics packs float64
TAIL = 3  # MAX part's tail: [schema changed, layout hash, -layout hash]
NUM_COUNTS = 2  # framework counts per metric in the SUM part
GLOO_MESSAGE_OVERHEAD = 144  # bytes gloo's TCP transport writes per message besides payload

# (kind sums, kind maxes) of the built-in scalar kinds, and the extra kinds' own
# (their MAX part also holds one extra-size slot)
KIND_SLOTS = {
    "mean": (2, 0),
    "sum": (2, 0),
    "max": (1, 1),
    "min": (1, 1),
    "last": (2, 2),
    "std": (0, 0),
    "dist": (1, 0),
}
EXTRA_KINDS = ("std", "dist")
MIX = ("mean", "sum", "max", "min", "last")  # the benchmarks' rotation of scalar kinds


@dataclass(frozen=True)
class Buffers:
    """rlmetrics' packed buffer sizes (floats) for one layout.

    Attributes:
        sums: the SUM part: every metric's kind sums and two framework counts.
        maxes: the MAX part's kind slots (one extra-size slot per std/dist metric).
        slots: metrics (one "logged" flag each in the MAX tail).
    """

    sums: int
    maxes: int
    slots: int

    @property
    def gather(self) -> int:
        """Floats per rank of the one-gather path: [SUM | MAX | logged | tail]."""
        return self.sums + self.maxes + self.slots + TAIL

    @property
    def pair(self) -> tuple[int, int]:
        """Floats of the pair's all_reduce(SUM) (with a NaN count per float of the MAX
        part) and all_reduce(MAX) ([MAX | logged | tail])."""
        return self.gather, self.maxes + self.slots + TAIL


def buffers(kinds: Iterable[str], bucket_sums: Sequence[int] = ()) -> Buffers:
    """The buffers of metrics of ``kinds`` plus one bucketed metric per entry of
    ``bucket_sums``, its number of additive slots, with 2 max slots (a histogram of E
    edges has E + 1 sums; a sketch of B buckets has B plus a few moments)."""
    sums = maxes = slots = 0
    for kind in kinds:
        kind_sums, kind_maxes = KIND_SLOTS[kind]
        sums += kind_sums + NUM_COUNTS
        maxes += kind_maxes + (1 if kind in EXTRA_KINDS else 0)
        slots += 1
    for bucket in bucket_sums:
        sums += bucket + NUM_COUNTS
        maxes += 2
        slots += 1
    return Buffers(sums, maxes, slots)


def mix(n: int) -> list[str]:
    """N scalar metrics in the benchmarks' rotation of kinds."""
    return [MIX[i % len(MIX)] for i in range(n)]


@dataclass(frozen=True)
class Collective:
    """One collective: ``op`` ("all_gather", "all_reduce", "barrier") of ``size`` bytes
    contributed per rank."""

    op: str
    size: int

    def payload(self, ranks: int, rank: int = 0) -> int:
        """Payload bytes ``rank`` sends (and, by symmetry of the ring, about what it
        receives)."""
        if ranks == 1 or self.op == "barrier":
            return 0
        if self.op == "all_gather":
            return (ranks - 1) * self.size
        return gloo_ring_allreduce(self.size, ranks, rank)[0]

    def rounds(self, ranks: int, backend: str = "gloo") -> int:
        """Sequential message rounds (the latency term)."""
        if ranks == 1:
            return 0
        log = math.ceil(math.log2(ranks))
        if self.op == "barrier":
            return log if backend == "gloo" else 2 * log
        if self.op == "all_gather":
            return ranks - 1
        return 2 * (ranks - 1) if backend == "gloo" else 2 * log

    def messages(self, ranks: int, rank: int = 0) -> int:
        """Messages ``rank`` writes in gloo (a ring round sends two chunks)."""
        if ranks == 1:
            return 0
        if self.op == "barrier":
            return math.ceil(math.log2(ranks))
        if self.op == "all_gather":
            return 2 * (ranks - 1)
        return gloo_ring_allreduce(self.size, ranks, rank)[1]


def gloo_ring_allreduce(total: int, ranks: int, rank: int) -> tuple[int, int]:
    """(bytes, messages) ``rank`` sends in gloo's ring all_reduce of ``total`` bytes of
    float64 (gloo/allreduce.cc: at least 2R segments of at most 1 MiB; a reduce-scatter
    and an all_gather phase each send R-1 segments per segment-per-rank; empty
    segments past the end are not sent). The group's total is exact; the gloo bundled
    with torch may place a partial segment on another rank than this count does."""
    segments = _round_up(max(math.ceil(total / (1 << 20)), 2 * ranks), ranks)
    per_rank = segments // ranks
    seg_bytes = _round_up(math.ceil(total / segments), FLOAT)
    span = segments * seg_bytes
    sent = messages = 0
    for start in ((rank + 1) * per_rank, rank * per_rank):  # reduce-scatter, all_gather
        for i in range(segments - per_rank):
            length = min(seg_bytes, total - ((start + i) * seg_bytes) % span)
            if length > 0:
                sent, messages = sent + length, messages + 1
    return sent, messages


def _round_up(value: int, multiple: int) -> int:
    return math.ceil(value / multiple) * multiple


def rlmetrics_sync(
    buf: Buffers, ranks: int, path: str, extras: Sequence[int] = ()
) -> list[Collective]:
    """The collectives of a steady-state ``compute()``: ``path`` "gather" (one
    all_gather) or "pair" (all_reduce SUM + MAX); ``extras`` the std/dist extra floats
    per rank (one more all_gather of their total)."""
    if path == "gather":
        out = [Collective("all_gather", FLOAT * buf.gather)]
    else:
        out = [Collective("all_reduce", FLOAT * part) for part in buf.pair]
    if extras:
        out.append(Collective("all_gather", FLOAT * sum(extras)))
    return out


def dist_extra(n: int) -> int:
    """Floats per rank of one dist metric's extra: n values and n keep flags (padded to
    the largest rank's n)."""
    return 2 * n


def std_extra() -> int:
    """Floats per rank of one std metric's extra: its (count, mean, M2) triple."""
    return 3


def pickle_bytes(n_metrics: int, micro: int, key_length: int = 24) -> int:
    """Pickled size of a dict of N keys to lists of ``micro`` floats (measured: 9 bytes
    per float, 7 per entry besides the key, about 20 per dict)."""
    return n_metrics * (key_length + 9 * micro + 7) + 20


def verl_sync(payload: int) -> list[Collective]:
    """``all_gather_object`` of a ``payload``-byte pickle: sizes, then padded bytes."""
    return [Collective("all_gather", 8), Collective("all_gather", payload)]


def torchmetrics_sync(n_metrics: int, states: int = 2, state_bytes: int = 4) -> list[Collective]:
    """``compute()`` of N metrics with ``states`` scalar states each (MeanMetric: two
    float32 0-d states): per state a barrier and an all_gather (gather_all_tensors)."""
    one = [Collective("barrier", 0), Collective("all_gather", state_bytes)]
    return one * (n_metrics * states)


def totals(
    collectives: Sequence[Collective], ranks: int, backend: str = "gloo", rank: int = 0
) -> dict[str, int]:
    """Per rank: collectives, payload bytes sent (= received), rounds, gloo messages."""
    return {
        "collectives": len(collectives),
        "bytes": sum(c.payload(ranks, rank) for c in collectives),
        "rounds": sum(c.rounds(ranks, backend) for c in collectives),
        "messages": sum(c.messages(ranks, rank) for c in collectives),
    }


def gloo_written(collectives: Sequence[Collective], ranks: int, rank: int = 0) -> int:
    """Bytes ``rank`` writes to its sockets in gloo: payload plus per-message overhead."""
    t = totals(collectives, ranks, rank=rank)
    return t["bytes"] + GLOO_MESSAGE_OVERHEAD * t["messages"]
