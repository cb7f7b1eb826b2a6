"""``rlmetrics._engine.fold.assemble`` on the host: flat parts of any mix of classes
(host arrays, CPU tensors of several dtypes and shapes, strided and expanded ones) come
out as one array in the parts' order, each element converted exactly as numpy converts
it alone. Both host layouts are covered: parts copied into place one by one (few or
large parts) and classes joined, then put back in order (many small parts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmetrics._engine.assemble import IN_PLACE_PART_SIZE, IN_PLACE_PARTS, assemble

TENSOR_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32)
HOST_DTYPES = (np.float64, np.float32, np.int64)


def part(draw: st.DrawFn, max_rows: int) -> np.ndarray | torch.Tensor:
    """One part: a host array or a CPU tensor (0-d, 1-D, 2-D, transposed, expanded)."""
    rows = draw(st.integers(0, max_rows))
    values = np.arange(rows * 3, dtype=np.float64) * draw(st.sampled_from([0.37, -1.5]))
    if draw(st.booleans()):
        return values[:rows].astype(draw(st.sampled_from(HOST_DTYPES)))
    tensor = torch.from_numpy(values).to(draw(st.sampled_from(TENSOR_DTYPES)))
    shape = draw(st.sampled_from(["0-d", "1-D", "2-D", "transposed", "expanded"]))
    if shape == "0-d":
        return tensor[0] if rows else tensor.new_tensor(2.5)
    if shape == "1-D":
        return tensor[:rows]
    if shape == "2-D":
        return tensor.reshape(rows, 3)
    if shape == "transposed":
        return tensor.reshape(3, rows).T
    return tensor[:1].expand(rows) if rows else tensor[:0]


@st.composite
def parts_of(draw: st.DrawFn, count: st.SearchStrategy[int], max_rows: int) -> list:
    return [part(draw, max_rows) for _ in range(draw(count))]


def numpy_truth(parts: list, dtype: type = np.float64) -> np.ndarray:
    """Each part on its own, converted by numpy (a tensor through float64, exact for
    these dtypes), then concatenated."""
    flat = [
        (p.to(torch.float64).numpy() if isinstance(p, torch.Tensor) else p).reshape(-1)
        for p in parts
    ]
    return np.concatenate([np.asarray(f, dtype=dtype) for f in flat] or [np.zeros(0, dtype)])


@settings(max_examples=60, deadline=None)
@given(parts_of(st.integers(1, IN_PLACE_PARTS + 8), max_rows=3 * IN_PLACE_PART_SIZE))
def test_few_or_large_parts_in_order(parts: list) -> None:
    out = assemble(parts, None)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, numpy_truth(parts))


@settings(max_examples=30, deadline=None)
@given(parts_of(st.integers(IN_PLACE_PARTS + 1, 3 * IN_PLACE_PARTS), max_rows=8))
def test_many_small_parts_in_order(parts: list) -> None:
    out = assemble(parts, None)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, numpy_truth(parts))


@pytest.mark.parametrize("count", [3, IN_PLACE_PARTS + 5])
def test_masks_stay_bool(count: int) -> None:
    gen = torch.Generator().manual_seed(count)
    parts = [
        torch.rand(4, 2, generator=gen) > 0.5 if i % 3 else np.arange(5) % 2 == 0
        for i in range(count)
    ]
    out = assemble(parts, None, np.bool_)
    assert out.dtype == np.bool_
    np.testing.assert_array_equal(out, numpy_truth(parts, np.bool_))


def test_the_result_is_a_copy() -> None:
    """A later change to a part does not reach the assembled array (records are the
    fold's own, but a kind may keep what it was given)."""
    tensor, host = torch.arange(4.0), np.arange(3.0)
    out = assemble([tensor, host], None)
    tensor += 10
    host += 10
    np.testing.assert_array_equal(out, [0, 1, 2, 3, 0, 1, 2])


@pytest.mark.parametrize("interleaved", [True, False])
def test_many_large_parts_in_order(interleaved: bool) -> None:
    """Many large parts of three classes: interleaved ones are copied into place, runs
    of one class joined (no permutation needed)."""
    gen = torch.Generator().manual_seed(7)
    count, size = IN_PLACE_PARTS + 10, IN_PLACE_PART_SIZE + 5
    parts = [
        [torch.randn(size, generator=gen), torch.randn(size, 1, dtype=torch.float64),
         np.arange(size) * 0.25][i % 3 if interleaved else 3 * i // count]
        for i in range(count)
    ]  # fmt: skip
    np.testing.assert_array_equal(assemble(parts, None), numpy_truth(parts))
