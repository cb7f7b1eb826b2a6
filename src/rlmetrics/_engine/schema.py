"""The schema every rank of a group agrees on: which metrics, of which kinds, configured
how. ``rlmetrics._engine.sync`` exchanges the payloads (one gather of bytes) on a
group's first sync and whenever a step's tail says some rank logged a name its layout
lacks; everything here is local and deterministic, so every rank computes the same
layout from the same payloads.

Schemas travel as JSON: nothing here unpickles what a peer sent.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlmetrics._engine.layout import BufferLayout
from rlmetrics._engine.record import MetricRecords
from rlmetrics.kinds import kind_names
from rlmetrics.kinds.base import Kind
from rlmetrics.kinds.rank_time import family_kind

KindOf = Callable[[str], Kind]
"""A tracker's kind by name (``Tracker.kind``: its own ``dist`` and ``quantile``)."""


def read_schema(rank: int, data: bytes) -> dict[str, Any]:
    """A rank's schema as its ``schema_payload`` made it: JSON of ``{"metrics": [[name, kind
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


def schema_payload(metric_records: Mapping[str, MetricRecords], kind_of: KindOf) -> bytes:
    """What this rank sends to agree on a schema: JSON of its metrics' (name, kind name,
    ``Kind.settings()``) and the settings of every kind it would report with (its own
    ``dist`` and ``quantile``, and each registered kind), so that a rank which did not
    log a name still reports it alike."""
    kinds = {name: kind_of(name).settings() for name in kind_names()}
    local = sorted(
        (name, records.kind.name, records.kind.settings())
        for name, records in metric_records.items()
    )
    return json.dumps({"metrics": local, "kinds": kinds}).encode()


def agreed_layout(kind_of: KindOf, payloads: Sequence[bytes]) -> BufferLayout:
    """The union of every rank's (name, kind) pairs, from every rank's
    ``schema_payload`` in rank order (every rank computes the same union).

    Raises:
        ValueError: on every rank, when ranks log a name with two kinds, or with one
            kind configured two ways (a histogram with other edges, a ``dist`` with
            other quantiles), or a kind some rank has not registered; naming the metric
            and both settings; or a payload is not a schema (naming the rank).
    """
    sent = [read_schema(rank, data) for rank, data in enumerate(payloads)]
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
    return BufferLayout([(name, kind_of(kind_name)) for name, (kind_name, _, _) in union.items()])
