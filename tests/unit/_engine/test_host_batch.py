"""HostBatch, the host fold's batch, computes what the plain Batch a kind author reads
computes: every built-in kind's reduce (and extras) on both, over random layouts, masks
and float32 values. Small batches sum by key in both, so they agree bit for bit; large
ones sum by segment in a HostBatch, which only rounds otherwise."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmetrics._engine.host_batch import SMALL, BatchRows, HostBatch
from rlmetrics.kinds import BUILTIN_KINDS, Batch, Kind
from rlmetrics.kinds.extra import ExtraKind

KINDS = [cls() for cls in BUILTIN_KINDS]


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[int], str, bool, int]:
    """Row lengths (empty rows too), how the elements are weighted, float32 or not, seed."""
    lengths = draw(st.lists(st.integers(0, 6), min_size=1, max_size=8))
    return (
        lengths,
        draw(st.sampled_from(["mask", "weight", "all"])),
        draw(st.booleans()),
        draw(st.integers(0, 2**31)),
    )


def _batches(
    lengths: list[int], weighting: str, narrow: bool, seed: int
) -> tuple[Batch, HostBatch]:
    """The same elements as a plain Batch and as a HostBatch, the unselected zeroed."""
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    values = np.round(rng.normal(size=n) * 100, 1)
    if narrow:
        values = values.astype(np.float32)
    if weighting == "mask":
        weights = rng.random(n) > 0.4
    elif weighting == "weight":
        weights = np.where(rng.random(n) > 0.3, rng.integers(1, 4, size=n) / 2, 0.0)
    else:
        weights = np.ones(n, dtype=np.bool_)
    float_weights = weights.astype(np.float64)
    plain = Batch(
        np.where(float_weights > 0, values.astype(np.float64), 0.0),
        float_weights,
        np.repeat(np.arange(len(lengths)), lengths),
        lengths,
        lengths,  # one call per row
    )
    rows = BatchRows(None, lengths, lengths)
    widened = np.empty(n) if narrow else None
    host = HostBatch(values.copy(), weights, rows, widened=widened, owned=True)
    host.zero_unselected()
    return plain, host


def _same(a: object, b: object, exact: bool) -> None:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if exact:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-9)
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y, exact)
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b)
    else:
        assert a == b


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@settings(max_examples=30, deadline=None)
@given(layouts())
def test_a_host_batch_reduces_as_a_plain_batch(
    kind: Kind, layout: tuple[list[int], str, bool, int]
) -> None:
    plain, host = _batches(*layout)
    for got, expected in zip(kind.reduce(host), kind.reduce(plain), strict=True):
        _same(got, expected, exact=True)
    if isinstance(kind, ExtraKind):
        _same(kind.reduce_extra(host), kind.reduce_extra(plain), exact=True)


def test_a_large_host_batch_sums_by_segment_within_rounding() -> None:
    lengths = [SMALL, 3, 0, SMALL // 2]
    plain, host = _batches(lengths, "mask", narrow=True, seed=3)
    assert not host.rows.keyed
    for kind in KINDS:
        for got, expected in zip(kind.reduce(host), kind.reduce(plain), strict=True):
            _same(got, expected, exact=False)
