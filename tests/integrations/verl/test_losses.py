"""The weights ``losses.log_micro_batch`` gives verl's per-micro-batch numbers.

verl's own ``agg_loss`` and ``masked_mean`` (the functions its ``ppo_loss`` and
``value_loss`` call) produce one number per micro-batch, normalised as verl's engine
normalises them (global token or sequence count, dp_size); merged by the Tracker they
must equal a numpy computation over the whole batch, for any partition into ranks and
micro-batches and every loss aggregation mode (float64 inputs: equal to 1e-9).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from rlmetrics import Tracker
from rlmetrics.integrations.verl.losses import log_micro_batch

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
ROWS, COLS = 8, 6
SCALE = 5.0  # loss_scale_factor for the "-norm" mode (a constant keeps verl invariant)


def _whole_batch(values: np.ndarray, mask: np.ndarray, mode: str) -> float:
    """What the mode means over the whole batch (numpy, float64)."""
    row_sums = (values * mask).sum(1)
    row_counts = mask.sum(1)
    if mode == "token-mean":
        return row_sums.sum() / mask.sum()
    if mode == "seq-mean-token-mean":
        return np.where(row_counts > 0, row_sums / np.maximum(row_counts, 1), 0).sum() / ROWS
    total = row_sums.sum() / ROWS
    return total / SCALE if mode.endswith("-norm") else total


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, COLS + 1, (ROWS,), generator=gen)  # empty responses too
    lengths[0] = COLS
    mask = torch.arange(COLS)[None, :] < lengths[:, None]
    return torch.randn(ROWS, COLS, generator=gen, dtype=torch.float64), mask


def _pieces(sizes: list[int], rows: int) -> list[tuple[int, int]]:
    """Contiguous (start, stop) pieces of ``rows`` from cut sizes (the rest last)."""
    out, start = [], 0
    for size in sizes:
        if start >= rows:
            break
        stop = min(rows, start + size)
        out.append((start, stop))
        start = stop
    if start < rows:
        out.append((start, rows))
    return out


def _log_split(values, mask, mode: str, dp_size: int, micro_sizes: list[int]) -> Tracker:
    """Each rank's micro-batches through verl's agg_loss / masked_mean, then logged."""
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.utils.torch_functional import masked_mean

    tracker = Tracker()
    info = {
        "dp_size": dp_size,
        "batch_num_tokens": int(mask.sum()),
        "global_batch_size": ROWS,
        "loss_scale_factor": SCALE if mode.endswith("-norm") else None,
    }
    per_rank = ROWS // dp_size
    for rank in range(dp_size):
        for start, stop in _pieces(micro_sizes, per_rank):
            lo, hi = rank * per_rank + start, rank * per_rank + stop
            v, m = values[lo:hi], mask[lo:hi]
            loss = agg_loss(loss_mat=v, loss_mask=m, loss_agg_mode=mode, **info)
            data = TensorDict({"response_mask": m}, batch_size=[hi - lo])
            for key in ("dp_size", "batch_num_tokens", "global_batch_size"):
                data.set_non_tensor(key, info[key])
            metrics = {
                "actor/pg_loss": loss.item(),
                "actor/pg_clipfrac": masked_mean(v, m).item() if m.any() else 0.0,
            }
            log_micro_batch(tracker, metrics, data, loss_agg_mode=mode)
    return tracker


@pytest.mark.parametrize("mode", MODES)
@given(
    dp_size=st.sampled_from([1, 2, 4]),
    micro_sizes=st.lists(st.integers(1, 8), min_size=1, max_size=8),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=25, deadline=None)
def test_any_split_gives_the_whole_batch(mode: str, dp_size: int, micro_sizes, seed) -> None:
    values, mask = _batch(seed)
    got = _log_split(values, mask, mode, dp_size, micro_sizes).compute()
    vals, msk = values.numpy(), mask.numpy()
    assert got["actor/pg_loss"] == pytest.approx(_whole_batch(vals, msk, mode), rel=1e-9)
    token_mean = (vals * msk).sum() / msk.sum()
    assert got["actor/pg_clipfrac"] == pytest.approx(token_mean, rel=1e-9)


def test_token_sum_keeps_verls_value() -> None:
    """ "token-sum" is a sum, already split-invariant in verl: left to verl."""
    values, mask = _batch(0)
    tracker = _log_split(values, mask, "token-sum", 1, [3])
    assert "actor/pg_loss" not in tracker.compute()


def test_unknown_metric_names_are_left_to_verl() -> None:
    tracker = Tracker()
    data = TensorDict({"response_mask": torch.ones(2, 3, dtype=torch.bool)}, batch_size=[2])
    log_micro_batch(tracker, {"actor/something": 1.0, "kl_coef": 0.1}, data, loss_agg_mode="x")
    assert len(tracker) == 0


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 7), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_response_counts_are_the_same_from_a_jagged_a_strided_nested_or_a_padded_mask(
    lengths: list[int], seed: int
) -> None:
    """(response tokens, sequences with one, sequences), against numpy over the rows; a
    row may be empty or all padding."""
    from rlmetrics.integrations.verl.losses import response_counts

    rng = np.random.default_rng(seed)
    rows = [rng.random(n) < 0.6 for n in lengths]
    expected = (
        float(sum(r.sum() for r in rows)),
        float(sum(r.any() for r in rows)),
        float(len(rows)),
    )
    padded = np.zeros((len(rows), max(lengths)), dtype=bool)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    pieces = [torch.from_numpy(r) for r in rows]
    masks = {
        "padded": torch.from_numpy(padded),
        "jagged": torch.nested.nested_tensor(pieces, layout=torch.jagged),
        "strided": torch.nested.nested_tensor(pieces, layout=torch.strided),
    }
    for layout, mask in masks.items():
        data = TensorDict({"response_mask": mask}, batch_size=[len(rows)])
        got = tuple(float(c) for c in response_counts(data))
        assert got == expected, layout
