"""Metrics carried by verl's DataProto: one test per DataProto operation, and ranks'
outputs merged by verl's real collect functions, equal bit for bit to one Tracker."""

from __future__ import annotations

import pickle
from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from verl.protocol import DataProto, DataProtoFuture, pad_dataproto_to_divisor, unpad_dataproto
from verl.single_controller.base.decorator import (
    Dispatch,
    collect_dp_compute_data_proto,
    collect_nd_compute_dataproto,
    dispatch_dp_compute_data_proto,
    get_predefined_dispatch_fn,
)
from verl.single_controller.base.worker_group import WorkerGroup

from rlmetrics import Tracker, TrackerState
from rlmetrics.integrations.tensordict import get_metrics as td_get_metrics
from rlmetrics.integrations.verl.dataproto import (
    METRICS_KEY,
    MetricsDataProto,
    attach_metrics,
    concat,
    get_metrics,
    metrics_field,
)


def make_data(seed: int, rows: int) -> DataProto:
    rng = np.random.default_rng(seed)
    return DataProto.from_dict(
        tensors={
            "loss": torch.from_numpy(rng.normal(0.0, 1.0, rows)),
            "mask": torch.from_numpy(rng.random(rows) < 0.8),
        },
        non_tensors={"uid": np.array([f"r{seed}-{i}" for i in range(rows)], dtype=object)},
        meta_info={"temperature": 1.0},
    )


def log_metrics(tracker: Tracker, data: DataProto) -> None:
    loss, mask = data.batch["loss"], data.batch["mask"]
    tracker.mean("loss", loss, weight=mask)
    tracker.std("loss_std", loss, weight=mask)
    tracker.max("loss_max", loss, mask=mask)
    tracker.min("loss_min", loss, mask=mask)
    tracker.sum("rows", torch.ones_like(loss))
    tracker.dist("loss_dist", loss, mask=mask)


def tracked(seed: int = 0, rows: int = 8) -> tuple[MetricsDataProto, dict[str, float]]:
    """A DataProto carrying metrics over its rows, and those metrics computed."""
    data = make_data(seed, rows)
    tracker = Tracker()
    log_metrics(tracker, data)
    return attach_metrics(data, tracker), tracker.compute()


def numbers(data: DataProto) -> dict[str, float]:
    return get_metrics(data).compute()


def fake_group(world_size: int) -> WorkerGroup:
    """A WorkerGroup with ``world_size`` workers: all verl's dispatch/collect use of it."""
    group = WorkerGroup(resource_pool=None)
    group._workers = [None] * world_size
    return group


# -- one test per DataProto operation --------------------------------------------------


def test_attach_returns_a_metrics_dataproto_sharing_the_rows() -> None:
    data = make_data(0, 4)
    out = attach_metrics(data, Tracker())
    assert type(out) is MetricsDataProto and out.batch is data.batch
    assert METRICS_KEY not in data.meta_info  # the caller's meta_info is not changed
    assert out.meta_info["temperature"] == 1.0


def test_chunk_every_piece_carries_the_batch_metrics_counted_once() -> None:
    data, expected = tracked(rows=8)
    pieces = data.chunk(4)
    assert all(type(p) is MetricsDataProto for p in pieces)
    assert all(numbers(p) == expected for p in pieces)
    assert numbers(DataProto.concat(pieces)) == expected  # not four times


def test_split_every_piece_carries_the_batch_metrics_counted_once() -> None:
    data, expected = tracked(rows=7)
    pieces = data.split(3)
    assert [len(p) for p in pieces] == [3, 3, 1]
    assert all(numbers(p) == expected for p in pieces)
    assert numbers(concat(pieces)) == expected


def test_slice_and_indexing_keep_the_metrics() -> None:
    data, expected = tracked()
    assert numbers(data.slice(2, 6)) == expected
    assert numbers(data[1:5]) == expected
    assert numbers(data[3]) == expected  # a DataProtoItem shares meta_info


def test_select_idxs_keeps_the_metrics() -> None:
    data, expected = tracked()
    for idxs in ([0, 5, 2], np.array([1, 3]), torch.tensor([True, False] * 4)):
        picked = data.select_idxs(idxs)
        assert type(picked) is MetricsDataProto and numbers(picked) == expected


def test_select_keeps_the_metrics_unless_meta_info_keys_leaves_them_out() -> None:
    data, expected = tracked()
    assert numbers(data.select(batch_keys=["loss"])) == expected
    assert numbers(data.select(meta_info_keys=[METRICS_KEY])) == expected
    assert metrics_field(data.select(meta_info_keys=["temperature"])) is None
    copied = data.select(deepcopy=True)
    assert numbers(copied) == expected
    assert metrics_field(copied) is not metrics_field(data)
    assert numbers(concat([data, copied])) == expected  # a deep copy is the same contribution


def test_union_unites_the_metrics_of_both() -> None:
    data, _ = tracked(0, 6)
    tracker = Tracker()
    log_metrics(tracker, make_data(1, 6))
    other = attach_metrics(DataProto.from_dict(tensors={"extra": torch.zeros(6)}), tracker)
    plain = DataProto(batch=data.batch.clone(), meta_info=dict(data.meta_info))
    with pytest.raises(AssertionError, match=METRICS_KEY):  # why verl's own union cannot
        DataProto.union(plain, other)
    expected = TrackerState.merge_all([get_metrics(data), get_metrics(other)]).compute()
    assert data.union(other) is data
    assert "extra" in data.batch and numbers(data) == expected
    assert data.meta_info["temperature"] == 1.0
    assert numbers(data.union(data.select(batch_keys=["loss"]))) == expected  # once


def test_pop_leaves_the_metrics_unless_named() -> None:
    data, expected = tracked()
    popped = data.pop(batch_keys=["loss"])
    assert metrics_field(popped) is None and numbers(data) == expected
    moved = data.pop(meta_info_keys=[METRICS_KEY])
    assert type(moved) is DataProto and numbers(moved) == expected
    assert metrics_field(data) is None


@pytest.mark.parametrize("interleave", [True, False])
def test_repeat_does_not_repeat_the_metrics(interleave: bool) -> None:
    data, expected = tracked(rows=5)
    repeated = data.repeat(repeat_times=3, interleave=interleave)
    assert len(repeated) == 15 and numbers(repeated) == expected


def test_reorder_keeps_the_metrics() -> None:
    data, expected = tracked()
    data.reorder(torch.tensor([7, 6, 5, 4, 3, 2, 1, 0]))
    assert data.non_tensor_batch["uid"][0] == "r0-7" and numbers(data) == expected


def test_padding_does_not_count_the_metrics_twice() -> None:
    data, expected = tracked(rows=5)
    data.padding(3)
    assert len(data) == 8 and numbers(data) == expected
    padded, pad = pad_dataproto_to_divisor(tracked(rows=5)[0], 4)
    assert (len(padded), pad) == (8, 3) and numbers(padded) == expected
    assert numbers(unpad_dataproto(padded, pad)) == expected


def test_to_keeps_the_metrics() -> None:
    data, expected = tracked()
    moved = data.to("cpu")
    assert moved is data and numbers(moved) == expected


def test_to_tensordict_and_back_keep_the_metrics() -> None:
    data, expected = tracked()
    td = data.to_tensordict()
    # rlmetrics.integrations.tensordict reads it as its own
    assert td_get_metrics(td).compute() == expected
    back = MetricsDataProto.from_tensordict(td)
    assert type(back) is MetricsDataProto and numbers(back) == expected
    assert numbers(concat([back, data])) == expected  # the same contribution


def test_pickling_keeps_the_metrics_and_their_identity() -> None:
    data, expected = tracked()
    back = pickle.loads(pickle.dumps(data))
    assert type(back) is MetricsDataProto and numbers(back) == expected
    assert numbers(concat([data, back])) == expected


def test_concat_merges_different_contributions() -> None:
    parts = [make_data(seed, rows) for seed, rows in [(0, 3), (1, 5), (2, 4)]]
    outputs = []
    for part in parts:
        tracker = Tracker()
        log_metrics(tracker, part)
        outputs.append(attach_metrics(part, tracker))
    with pytest.raises(AssertionError, match=METRICS_KEY):  # verl's concat compares meta_info
        DataProto.concat(outputs)
    merged = MetricsDataProto.concat(outputs)
    assert len(merged) == 12
    check_merged(merged, outputs, DataProto.concat(parts))
    plain = [DataProto(batch=o.batch, meta_info=o.meta_info) for o in outputs]
    check_merged(concat(plain), outputs, DataProto.concat(parts))  # plain ones too


def test_attach_and_reading_reject_bad_input() -> None:
    with pytest.raises(TypeError, match="metrics must be a Tracker"):
        attach_metrics(make_data(0, 2), {"loss": 1.0})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="data must be a DataProto"):
        attach_metrics({"loss": 1.0}, Tracker())  # type: ignore[arg-type]
    foreign = make_data(0, 2)
    foreign.meta_info[METRICS_KEY] = {"loss": 1.0}
    with pytest.raises(TypeError, match="reserved for rlmetrics"):
        get_metrics(foreign)
    assert get_metrics(make_data(0, 2)).compute() == TrackerState().compute()


# -- verl's dispatch and collect functions ---------------------------------------------


def run_rank(piece: DataProto) -> DataProto:
    """One rank: receives its piece as Ray would (pickled), logs and returns metrics."""
    piece = pickle.loads(pickle.dumps(piece))
    tracker = Tracker()
    log_metrics(tracker, piece)
    out = DataProto.from_dict(tensors={"score": piece.batch["loss"] * 2})
    return pickle.loads(pickle.dumps(attach_metrics(out, tracker)))


EXACT = ("loss_max", "loss_min", "rows", "loss_dist/")
"""Metrics whose value does not depend on how the rows were partitioned, bit for bit."""


def check_merged(collected: DataProto, outputs: list[DataProto], data: DataProto) -> None:
    """``collected`` carries the ranks' states merged, and the numbers of one Tracker.

    Bit for bit: the merge of the ranks' states in rank order (what a gloo group's
    ``compute()`` returns too), and one Tracker over ``data`` for the kinds that are
    partition invariant to the bit (max, min, sum of integers, distribution); a weighted
    sum or Chan's merge rounds differently when the rows are split, so mean and std
    match one Tracker and numpy to 1e-12.
    """
    got = numbers(collected)
    assert got == TrackerState.merge_all([get_metrics(o) for o in outputs]).compute()
    tracker = Tracker()
    log_metrics(tracker, data)
    single = tracker.compute()
    assert got.keys() == single.keys()
    for name, value in single.items():
        if name.startswith(EXACT):
            assert got[name] == value, name
        else:
            assert got[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name
    loss, mask = data.batch["loss"].numpy(), data.batch["mask"].numpy()
    assert got["rows"] == len(loss)
    if not mask.any():  # every row masked: no value to report
        assert "loss" not in got and "loss_max" not in got
        return
    np.testing.assert_allclose(got["loss"], loss[mask].mean(), rtol=1e-12)
    np.testing.assert_allclose(got["loss_std"], loss[mask].std(), rtol=1e-9)
    assert got["loss_max"] == loss[mask].max()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_dp_compute_proto_collect_merges_the_ranks_metrics(world_size: int) -> None:
    data = make_data(7, 12)
    group = fake_group(world_size)
    (pieces,), _ = dispatch_dp_compute_data_proto(group, data)
    outputs = [run_rank(piece) for piece in pieces]
    collected = collect_dp_compute_data_proto(group, outputs)
    assert type(collected) is MetricsDataProto and len(collected) == 12
    check_merged(collected, outputs, data)
    registered = get_predefined_dispatch_fn(Dispatch.DP_COMPUTE_PROTO)["collect_fn"]
    check_merged(registered(group, outputs), outputs, data)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=5),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_any_partition_collects_to_the_same_numbers(sizes: list[int], seed: int) -> None:
    """Ranks with any numbers of rows: verl's collect gives the ranks' merged states."""
    data = make_data(seed, sum(sizes))
    bounds = np.cumsum([0, *sizes])
    outputs = [run_rank(data.slice(a, b)) for a, b in pairwise(bounds)]
    check_merged(collect_dp_compute_data_proto(fake_group(len(sizes)), outputs), outputs, data)


def test_nd_compute_collect_merges_the_collected_ranks_only() -> None:
    """Four ranks, two data-parallel groups of two (a TP pair each): one rank per group
    is collected, as verl's collect mask says; the replicas' metrics stay out."""
    data = make_data(11, 10)
    group = fake_group(4)
    dp_rank_mapping, collect_mask = [0, 0, 1, 1], [True, False, True, False]
    # dispatch_nd_compute_dataproto's split, without its ray.put of the pieces
    pieces = [data.chunk(2)[dp_rank] for dp_rank in dp_rank_mapping]
    outputs = [run_rank(piece) for piece in pieces]
    collected = collect_nd_compute_dataproto(collect_mask, group, outputs)
    assert len(collected) == 10
    check_merged(collected, [outputs[0], outputs[2]], data)


def test_driver_metrics_passed_through_by_every_rank_count_once() -> None:
    """The driver's batch carries metrics; each rank unions its output with its input
    piece (so all pass the driver's on) and adds its own: all counted once."""
    data, _ = tracked(3, 8)
    group = fake_group(2)
    (pieces,), _ = dispatch_dp_compute_data_proto(group, data)
    outputs, own = [], []
    for piece in pieces:
        out = run_rank(piece)
        own.append(get_metrics(out))
        outputs.append(out.union(piece.select(batch_keys=[], non_tensor_batch_keys=[])))
    collected = numbers(collect_dp_compute_data_proto(group, outputs))
    # contributions in first-seen order: rank 0's, the driver's, rank 1's
    assert collected == TrackerState.merge_all([own[0], get_metrics(data), own[1]]).compute()
    assert collected["rows"] == 16.0  # the driver's 8 rows once, and the ranks' 8


def test_blocking_false_futures_merge_the_ranks_metrics(verl_ray: None) -> None:
    """A ``blocking=False`` call: verl's collect returns a DataProtoFuture over the ranks'
    Ray objects; its ``get`` merges their metrics while the integration is on, and raises
    verl's own AssertionError once ``disable()`` restores verl's ``get``."""
    import ray

    from rlmetrics.integrations.verl import disable, enable, is_enabled

    data = make_data(5, 9)
    group = fake_group(3)
    outputs = [run_rank(piece) for piece in data.chunk(3)]
    future = collect_nd_compute_dataproto([True] * 3, group, [ray.put(o) for o in outputs])
    assert isinstance(future, DataProtoFuture) and is_enabled()
    check_merged(future.get(), outputs, data)
    disable()
    try:
        with pytest.raises(AssertionError, match=METRICS_KEY):
            future.get()
    finally:
        enable()
    chunked = future.chunk(3)[1].get()  # a future passed on to another worker group
    assert len(chunked) == 3
    check_merged(chunked, outputs, data)
