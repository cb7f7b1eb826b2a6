"""Metrics carried by TensorDict batches: one test per container operation, the
dispatch/collect helpers, and a Ray round trip equal to a gloo group's compute()."""

from __future__ import annotations

import importlib
import pickle
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from rlmetrics import Tracker, TrackerState, register_kind
from rlmetrics.kinds.histogram import Histogram

from gloo_ranks import ok_results, run_ranks

tensordict = pytest.importorskip("tensordict", reason="tensordict is an optional extra")
from tensordict import NonTensorData, NonTensorStack, TensorDict  # noqa: E402

from rlmetrics.integrations.tensordict import (  # noqa: E402
    METRICS_KEY,
    attach_metrics,
    collect,
    dispatch,
    get_metrics,
    is_replica,
    metrics_field,
    update,
)

from local_ray import local_ray  # noqa: E402

HIST = Histogram(name="td_test_hist", edges=(-2.0, -1.0, 0.0, 1.0, 2.0))


def make_batch(seed: int, rows: int) -> TensorDict:
    rng = np.random.default_rng(seed)
    return TensorDict(
        {
            "loss": torch.from_numpy(rng.normal(0.0, 1.0, rows)),
            "mask": torch.from_numpy(rng.random(rows) < 0.8),
            "obs": torch.from_numpy(rng.normal(size=(rows, 3))),
        },
        batch_size=[rows],
    )


def log_metrics(tracker: Tracker, piece: TensorDict) -> None:
    """The metrics a worker logs for its piece of the batch."""
    register_kind(HIST, exist_ok=True)  # every process registers the kinds it uses
    loss, mask = piece["loss"], piece["mask"]
    tracker.mean("loss", loss, weight=mask)
    tracker.std("loss_std", loss, weight=mask)
    tracker.max("loss_max", loss, mask=mask)
    tracker.dist("loss_dist", loss, mask=mask)
    tracker.log("loss_hist", loss, weight=mask, kind=HIST.name)
    tracker.sum("rows", torch.ones_like(loss))
    tracker.last("lr", 1e-4)


def worker_step(piece: TensorDict) -> TensorDict:
    """What a worker does: compute something per row, log metrics, attach them."""
    tracker = Tracker()
    log_metrics(tracker, piece)
    out = TensorDict({"score": piece["loss"] * 2}, batch_size=piece.batch_size)
    return attach_metrics(out, tracker)


def metrics_of(td: TensorDict) -> dict[str, float]:
    return get_metrics(td).compute()


@pytest.fixture(scope="module", autouse=True)
def hist_kind() -> None:
    register_kind(HIST, exist_ok=True)


@pytest.fixture
def outputs() -> list[TensorDict]:
    return [worker_step(piece) for piece in dispatch(make_batch(0, 20), 2)]


@pytest.fixture
def expected() -> dict[str, float]:
    """The metrics of the whole batch, logged by one worker."""
    return metrics_of(worker_step(make_batch(0, 20)))


# -- attach / get -----------------------------------------------------------------------
def test_attach_and_get(outputs: list[TensorDict]) -> None:
    td = make_batch(1, 4)
    assert get_metrics(td) == TrackerState()
    tracker = Tracker()
    tracker.mean("a", 2.0)
    assert attach_metrics(td, tracker) is td
    assert metrics_of(td) == {"a": 2.0}
    attach_metrics(td, get_metrics(outputs[0]))  # replaces
    assert metrics_of(td) == metrics_of(outputs[0])
    assert isinstance(td.get(METRICS_KEY), NonTensorData)
    with pytest.raises(TypeError, match="expects a Tracker, TrackerState or TensorDict, got dict"):
        attach_metrics(td, {"a": 1.0})
    moved = attach_metrics(TensorDict({"score": torch.zeros(3)}, [3]), outputs[0])
    assert metrics_field(moved) == metrics_field(outputs[0])
    assert metrics_of(collect([outputs[0], moved])) == metrics_of(outputs[0])  # once
    td.set_non_tensor(METRICS_KEY, "something else")
    with pytest.raises(TypeError, match="'_rlmetrics' is reserved for rlmetrics, but holds str"):
        get_metrics(td)


def test_missing_tensordict_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensordict", None)
    monkeypatch.delitem(sys.modules, "rlmetrics.integrations.tensordict")
    with pytest.raises(ImportError, match=r"pip install 'rlmetrics\[tensordict\]'"):
        importlib.import_module("rlmetrics.integrations.tensordict")


# -- concatenation ----------------------------------------------------------------------
def test_collect_merges_outputs(outputs: list[TensorDict], expected: dict) -> None:
    out = collect(outputs)
    assert out.batch_size == torch.Size([20])
    assert torch.equal(out["score"], torch.cat([o["score"] for o in outputs]))
    assert isinstance(out.get(METRICS_KEY), NonTensorData)
    assert metrics_of(out) == pytest.approx(expected, rel=1e-12)


def test_native_cat_merges_each_contribution_once(
    outputs: list[TensorDict], expected: dict
) -> None:
    out = torch.cat(outputs)  # tensordict stacks the per-row entries
    assert isinstance(out.get(METRICS_KEY), NonTensorStack)
    assert metrics_of(out) == metrics_of(collect(outputs))
    assert metrics_of(torch.cat([out, outputs[0]])) == metrics_of(out)  # no double count
    assert metrics_of(out) == pytest.approx(expected, rel=1e-12)


def test_native_cat_loses_zero_row_outputs_collect_does_not() -> None:
    full, empty = worker_step(make_batch(2, 5)), worker_step(make_batch(3, 0))
    empty_metrics = Tracker()
    empty_metrics.sum("only_here", 1.0)
    attach_metrics(empty, empty_metrics)
    assert "only_here" not in metrics_of(torch.cat([full, empty]))  # tensordict drops it
    assert metrics_of(collect([full, empty]))["only_here"] == 1.0


def test_collect_of_metrics_only_outputs() -> None:
    outs = []
    for value in (1.0, 3.0):
        tracker = Tracker()
        tracker.mean("x", value)
        outs.append(attach_metrics(TensorDict({}, batch_size=[]), tracker))
    out = collect(outs)
    assert out.batch_size == torch.Size([]) and metrics_of(out) == {"x": 2.0}


def test_collect_leaves_replicas_out(outputs: list[TensorDict], expected: dict) -> None:
    copy = pickle.loads(pickle.dumps(outputs[1]))
    marked = attach_metrics(copy.clone(), get_metrics(copy), replica=True)  # worker-side mark
    assert is_replica(marked) and not is_replica(outputs[1])
    by_mark = collect([outputs[0], marked, outputs[1]])
    by_flag = collect([outputs[0], outputs[1], copy], replicas=[False, False, True])
    for out in (by_mark, by_flag):
        assert out.batch_size == torch.Size([20])
        assert metrics_of(out) == pytest.approx(expected, rel=1e-12)
    # without marks, a replica's separately attached metrics count twice:
    doubled = collect([*outputs, attach_metrics(copy.clone(), get_metrics(copy))])
    assert metrics_of(doubled)["rows"] == 30.0
    with pytest.raises(ValueError, match="got 2 outputs but 1 replica flags"):
        collect(outputs, replicas=[True])
    with pytest.raises(ValueError, match="all replicas"):
        collect(outputs, replicas=[True, True])


# -- split / chunk / dispatch -----------------------------------------------------------
@pytest.mark.parametrize("op", ["split", "chunk", "unbind"])
def test_native_split_copies_to_every_piece_counted_once(op: str, expected: dict) -> None:
    batch = collect([worker_step(make_batch(0, 20))])
    pieces = {"split": batch.split(7), "chunk": batch.chunk(3), "unbind": batch.unbind(0)}[op]
    assert all(metrics_of(p) == metrics_of(batch) for p in pieces)  # each piece: all of it
    if op == "unbind":  # pieces without batch dimensions: stack them back
        assert metrics_of(torch.stack(list(pieces))) == metrics_of(batch)
    else:
        assert metrics_of(torch.cat(list(pieces))) == metrics_of(batch)
        assert metrics_of(collect(list(pieces))) == metrics_of(batch)


@pytest.mark.parametrize(("rows", "workers"), [(20, 2), (10, 3), (2, 4)])
def test_dispatch_puts_metrics_on_the_first_piece(rows: int, workers: int) -> None:
    batch = worker_step(make_batch(4, rows))
    pieces = dispatch(batch, workers)
    assert [p.batch_size[0] for p in pieces] == [
        len(a) for a in np.array_split(range(rows), workers)
    ]
    assert metrics_of(pieces[0]) == metrics_of(batch)
    assert all(p.get(METRICS_KEY, None) is None for p in pieces[1:])
    again = collect(pieces)
    assert torch.equal(again["score"], batch["score"]) and metrics_of(again) == metrics_of(batch)
    with pytest.raises(ValueError, match="num_workers must be an int >= 1, got 0"):
        dispatch(batch, 0)


# -- indexing, select, exclude ----------------------------------------------------------
@pytest.mark.parametrize(
    "index", [0, slice(2, 9), torch.tensor([3, 1, 4]), torch.arange(20) % 3 == 0, (..., None)]
)
def test_indexing_keeps_the_whole_state(outputs: list[TensorDict], index: object) -> None:
    batch = collect(outputs)
    view = batch[index]
    assert metrics_of(view) == metrics_of(batch)
    assert metrics_field(view) == metrics_field(batch)  # the same contributions: a later
    # concatenation with the batch or its other views counts them once


def test_indexing_after_native_cat_keeps_the_rows_contributions(
    outputs: list[TensorDict],
) -> None:
    stacked = torch.cat(outputs)  # per-row entries: rows 0-9 first worker, 10-19 second
    assert metrics_of(stacked[:10]) == metrics_of(outputs[0])
    assert metrics_of(collect([stacked])[:10]) == metrics_of(stacked)  # collect normalises


def test_select_drops_and_exclude_keeps(outputs: list[TensorDict]) -> None:
    batch = collect(outputs)
    assert get_metrics(batch.select("score")) == TrackerState()
    assert metrics_of(batch.select("score", METRICS_KEY)) == metrics_of(batch)
    assert metrics_of(batch.exclude("score")) == metrics_of(batch)
    assert get_metrics(batch.exclude(METRICS_KEY)) == TrackerState()


# -- update -----------------------------------------------------------------------------
def test_update_merges_native_update_replaces(outputs: list[TensorDict], expected: dict) -> None:
    first, second = outputs[0].clone(), outputs[1].clone()
    second = second.set("other", second["score"] + 1)
    native = first.clone().update(second)
    assert metrics_of(native) == metrics_of(outputs[1])  # tensordict replaced the entry
    merged = update(first.clone(), second)
    assert merged.get("other", None) is not None
    assert metrics_of(merged) == pytest.approx(expected, rel=1e-12)
    derived = outputs[0].clone().set("other", outputs[0]["score"])  # carries first's own
    assert metrics_of(update(outputs[0].clone(), derived)) == metrics_of(outputs[0])


# -- device moves, clone, pickle --------------------------------------------------------
def test_device_and_dtype_moves_leave_the_state_alone(outputs: list[TensorDict]) -> None:
    batch = collect(outputs)
    field = batch.get(METRICS_KEY).data
    moved = [batch.to("cpu"), batch.cpu(), batch.to(torch.float32), batch.to("meta")]
    if torch.cuda.is_available():
        moved += [batch.cuda(), batch.to("cuda").cpu()]
    for td in moved:
        assert td.get(METRICS_KEY).data is field
        assert metrics_of(td) == metrics_of(batch)


def test_clone_and_pickle_keep_the_state(outputs: list[TensorDict]) -> None:
    batch = collect(outputs)
    for copy in (batch.clone(), pickle.loads(pickle.dumps(batch))):
        assert metrics_of(copy) == metrics_of(batch)
        both = torch.cat([batch, copy])  # equal contributions: tensordict keeps one entry
        assert isinstance(both.get(METRICS_KEY), NonTensorData)
        assert metrics_of(both) == metrics_of(batch)


# -- Ray: workers return TensorDicts; the driver's collect equals a gloo group ----------
@pytest.fixture(scope="module")
def ray_session() -> Iterator[object]:
    """One local Ray for the module (see tests/_support/local_ray.py)."""
    with local_ray(num_cpus=2):
        import ray

        yield ray


@pytest.mark.slow  # a local Ray and two gloo ranks
def test_ray_collect_equals_gloo_compute(ray_session: object) -> None:
    ray = ray_session
    remote_step = ray.remote(num_cpus=1)(worker_step)
    pieces = dispatch(make_batch(5, 21), 2)
    outputs = ray.get([remote_step.remote(piece) for piece in pieces])
    driver = metrics_of(collect(outputs))
    gloo = ok_results(run_ranks(gloo_compute, 2))
    assert gloo[0] == gloo[1] == driver
    assert {"loss", "loss_std", "loss_dist/p50", "loss_hist/p50", "rows", "lr"} <= driver.keys()
    assert driver["rows"] == 21.0


def gloo_compute(rank: int, world_size: int) -> dict[str, float]:
    """One gloo rank: the same worker step on its dispatched piece, then compute()."""
    tracker = Tracker()
    log_metrics(tracker, dispatch(make_batch(5, 21), world_size)[rank])
    return tracker.compute()
