"""Tracker.compute() over real gloo process groups equals the single-process result.

The checks share three spawned groups (2, 3 and 4 ranks), each running the rank
functions of several tests one after another (``gloo_ranks.run_together``); a check
that counts collectives makes its own group so that it starts from nothing cached. A
rank that dies gets a group of its own.
"""

from __future__ import annotations

import functools
import math
import os
import struct
import time
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as tdist

from rlmetrics import RejectedInputError, SyncTimeoutError, Tracker, TrackerState
from rlmetrics._engine import sync as rd

from gloo_ranks import ok_results, run_ranks, run_together
from helpers import log_every_kind

KINDS = ("mean", "sum", "max", "min", "std", "last", "dist")


def make_batch(seed: int, size: int) -> dict[str, np.ndarray]:
    """Values with a large offset (std exactness), positive weights with zeros, a mask."""
    rng = np.random.default_rng(seed)
    return {
        "value": rng.normal(1e3, 3.0, size),
        "weight": rng.integers(0, 4, size).astype(np.float64),
        "mask": rng.random(size) < 0.7,
    }


def split(rng: np.random.Generator, indices: np.ndarray, parts: int) -> list[np.ndarray]:
    """Random uneven split, empty parts allowed."""
    cuts = np.sort(rng.integers(0, len(indices) + 1, parts - 1))
    return np.split(indices, cuts)


def partition_run(rank: int, world: int, seed: int) -> tuple[dict, dict, dict]:
    """Each rank logs its random share in random micro-batches.

    Returns (synced result, whole batch logged at once, every piece logged in one
    process): the last includes the names only some pieces log.
    """
    batch = make_batch(seed, 37)
    rng = np.random.default_rng(seed + 1)  # the same split on every rank
    shares = split(rng, rng.permutation(37), world)

    def pieces(r: int) -> list[np.ndarray]:
        return split(np.random.default_rng(seed + 2 + r), shares[r], 4)

    tracker = Tracker()
    for piece in pieces(rank):
        log_every_kind(tracker, batch, piece)
    whole = Tracker()
    log_every_kind(whole, batch, np.arange(37))
    one_process = Tracker()
    for r in range(world):
        for piece in pieces(r):
            log_every_kind(one_process, batch, piece)
    return tracker.compute(), whole.compute(sync=False), one_process.compute(sync=False)


def assert_close(actual: dict, expected: dict, rtol: float = 1e-12) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert math.isclose(actual[key], value, rel_tol=rtol, abs_tol=1e-9), (
            key,
            actual[key],
            value,
        )


def without(metrics: dict, prefix: str) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(prefix)}


def run_many_partitions(rank: int, world: int) -> list:
    return [partition_run(rank, world, seed) for seed in range(6)]


@pytest.mark.parametrize("world", [2, 4])
def test_sync_equals_single_process(world: int, request: pytest.FixtureRequest) -> None:
    per_rank = ok_results(ranks(request, world)["partitions"])
    for seed_results in zip(*per_rank, strict=True):
        synced = [result[0] for result in seed_results]
        assert all(s == synced[0] for s in synced), "ranks got different dicts"
        _, whole, one_process = seed_results[0]
        assert_close(synced[0], one_process)
        assert_close(without(synced[0], "sometimes"), without(whole, "sometimes"))
        assert synced[0]["m/last"] == 0.25


def empty_and_partial_ranks(rank: int, world: int) -> list[dict]:
    """Rank 0 logs nothing in step 1; names appear and vanish between steps."""
    tracker = Tracker()
    outs = []
    if rank != 0:
        tracker.mean("loss", float(rank), weight=float(rank))
        tracker.max(f"only_rank_{rank}", 1.0)
    outs.append(tracker.compute())
    tracker.mean("loss", 1.0)  # every rank, steady schema subset
    outs.append(tracker.compute())
    tracker.sum("new", 2.0)  # a new name on every rank: re-agreement
    outs.append(tracker.compute())
    outs.append(tracker.compute())  # nothing logged anywhere
    return outs


def test_empty_ranks_and_changing_names(three_ranks: Session) -> None:
    per_rank = ok_results(three_ranks["empty_and_partial"])
    assert all(r == per_rank[0] for r in per_rank)
    step1, step2, step3, step4 = per_rank[0]
    assert step1 == {"loss": (1 * 1 + 2 * 2) / 3, "only_rank_1": 1.0, "only_rank_2": 1.0}
    assert step2 == {"loss": 1.0}
    assert step3 == {"new": 6.0}
    assert step4 == {}


def subgroups(rank: int, world: int) -> dict:
    evens = tdist.new_group([0, 2])
    odds = tdist.new_group([1, 3])
    tracker = Tracker()
    tracker.sum("rank_sum", float(rank))
    tracker.mean("rank_mean", float(rank))
    return tracker.compute(group=evens if rank % 2 == 0 else odds)


def test_subgroup_sync(four_ranks: Session) -> None:
    per_rank = ok_results(four_ranks["subgroups"])
    assert per_rank[0] == per_rank[2] == {"rank_sum": 2.0, "rank_mean": 1.0}
    assert per_rank[1] == per_rank[3] == {"rank_sum": 4.0, "rank_mean": 2.0}


def device_mesh(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tracker = Tracker()
    # tp replicas of one dp rank log the same data; merging over dp counts it once.
    tracker.mean("x", float(mesh.get_local_rank("dp")))
    tracker.sum("n", 1.0)
    return tracker.compute(group=(mesh, "dp"))


def test_device_mesh_dimension(four_ranks: Session) -> None:
    per_rank = ok_results(four_ranks["device_mesh"])
    assert all(r == {"x": 0.5, "n": 2.0} for r in per_rank)


def kind_conflict(rank: int, world: int) -> str:
    tracker = Tracker()
    tracker.mean("shared", 1.0)
    if rank == 0:
        tracker.mean("clash", 1.0)
    else:
        tracker.max("clash", 1.0)
    try:
        tracker.compute(timeout=30)
    except ValueError as error:
        return str(error)
    return "no error"


def test_kind_conflict_raises_on_every_rank(two_ranks: Session) -> None:
    messages = ok_results(two_ranks["kind_conflict"])
    for message in messages:
        assert "'clash'" in message and "'mean'" in message and "'max'" in message


def configured_differently(rank: int, world: int) -> dict[str, Any]:
    """Per case, what ``compute()`` gave on this rank: the error's message, or the keys.

    The ranks configure a kind two ways (quantiles, a histogram's bins; a kind one rank
    has not registered); ``same`` configures both alike and returns its values."""
    from rlmetrics import Window, register_kind, unregister_kind
    from rlmetrics.kinds.histogram import Histogram

    values = [float(v) for v in range(4 * rank, 4 * rank + 4)]
    quantiles = (0.5,) if rank == 0 else (0.9,)

    def tdist(t: Tracker) -> None:
        t.dist("d", values)

    def one_rank_logs(t: Tracker) -> None:
        if rank == 0:
            t.dist("d", values)
        t.mean("m", 1.0)

    def sketch(t: Tracker) -> None:
        t.log("q", values, kind="quantile")

    def histogram(**config: Any) -> Any:
        def log(t: Tracker) -> None:
            register_kind(Histogram(name="cfg_hist", edges=(0.0, 4.0, 8.0), **config))
            t.log("h", values, kind="cfg_hist")

        return log

    def only_rank_0_registers(t: Tracker) -> None:
        if rank == 0:
            register_kind(Histogram(name="cfg_hist", edges=(0.0, 4.0, 8.0)))
            t.log("h", values, kind="cfg_hist")
        t.mean("m", 1.0)

    cases = {
        "dist": (tdist, quantiles),
        "dist/one_rank_logs": (one_rank_logs, quantiles),
        "quantile": (sketch, quantiles),
        "histogram/quantiles": (histogram(quantiles=quantiles), (0.5,)),
        "histogram/report_bins": (histogram(report_bins=rank == 0), (0.5,)),
        "window": (tdist, quantiles),
        "same": (tdist, (0.25, 0.75)),
        "unregistered": (only_rank_0_registers, (0.5,)),  # last: on main, rank 0 waits
    }
    out = {}
    for case, (log, tracker_quantiles) in cases.items():
        tracker = Tracker(quantiles=tracker_quantiles)
        try:
            log(tracker)
            if case == "window":
                window = Window(tracker, every=None, timeout=30)
                window.step()
                result = window.flush()
            else:
                result = tracker.compute(timeout=30)
            out[case] = result
        except ValueError as error:
            out[case] = f"ValueError: {error}"
        finally:
            unregister_kind("cfg_hist")
    return out


def test_a_kind_configured_two_ways_on_the_ranks_raises_on_every_rank(two_ranks: Session) -> None:
    """Other quantiles (dist, quantile, a histogram's), a histogram with and without its
    bins, through a Window too, and a kind one rank has not registered: every rank raises
    naming the metric and both settings, rather than reporting other keys per rank."""
    per_rank = ok_results(two_ranks["configured_differently"])
    for case, wanted in {
        "dist": ["'d'", "(0.5,)", "(0.9,)"],
        "dist/one_rank_logs": ["'d'", "(0.5,)", "(0.9,)"],
        "quantile": ["'q'", "(0.5,)", "(0.9,)"],
        "histogram/quantiles": ["'h'", "(0.5,)", "(0.9,)"],
        "histogram/report_bins": ["'h'", "True)", "False)"],
        "window": ["d'", "(0.5,)", "(0.9,)"],
        "unregistered": ["'h'", "'cfg_hist'", "rank 1 has not registered"],
    }.items():
        for rank, out in enumerate(per_rank):
            message = out[case]
            assert str(message).startswith("ValueError: ranks disagree on metric kinds"), (
                case,
                rank,
                message,
            )
            assert all(part in message for part in wanted), (case, rank, message)
            if case != "unregistered":
                assert "on rank 0" in message and "on rank 1" in message, message
    values = np.arange(8.0)
    want = {"d/mean": values.mean(), "d/std": values.std(), "d/min": 0.0, "d/max": 7.0}
    want |= {"d/p25": np.quantile(values, 0.25), "d/p75": np.quantile(values, 0.75)}
    assert per_rank[0]["same"] == per_rank[1]["same"] == {k: float(v) for k, v in want.items()}


def killed_rank(rank: int, world: int) -> float:
    tracker = Tracker()
    tracker.mean("x", 1.0)
    tracker.compute(timeout=20)  # a healthy first step
    if rank == 1:
        os._exit(0)  # dies in the middle of the next step
    tracker.mean("x", 2.0)
    start = time.monotonic()
    try:
        tracker.compute(timeout=3.0)
    except SyncTimeoutError:
        return time.monotonic() - start
    raise AssertionError("compute() returned although rank 1 died")


def test_killed_rank_gives_timeout_error() -> None:
    outcome = run_ranks(killed_rank, 2, allow_missing=(1,), timeout=60)
    status, elapsed = outcome[0]
    assert status == "ok", elapsed
    assert elapsed < 15.0


def modified_on_one_rank(rank: int, world: int, by: bool = False, early: bool = False) -> list[Any]:
    """Three steps; rank 0 changes a logged tensor in place in the first (logged with
    ``by=``, tensor labels, when ``by``; found by an early fold, in the next log call,
    when ``early``). Each rank goes on to its next step after an error (as a training
    loop that logs it would). The tensors are kept by reference, as a device tensor is
    (a CPU tensor is copied at the call: no change after it reaches the record)."""
    tracker, out = Tracker(), []
    tracker.copy_cpu_tensors = False
    if early:
        tracker.record_limit = 2  # the second call of a step folds the first one's record
    for step in range(3):
        x = torch.tensor([float(rank + 1)])
        if by:
            tracker.mean("x", x, by=torch.tensor([0]), labels={0: "a"})
        else:
            tracker.mean("x", x)
        if rank == 0 and step == 0 and early:
            x.add_(10)
        tracker.sum("n", 1.0)
        if rank == 0 and step == 0 and not early:
            x.add_(10)
        try:
            out.append(tracker.compute(timeout=10))
        except ValueError as error:  # ModifiedInputError, SyncTimeoutError
            out.append(type(error).__name__)
    return out


@pytest.mark.parametrize("early", [False, True], ids=["at compute", "by an early fold"])
def test_a_tensor_changed_in_place_on_one_rank_keeps_the_ranks_in_step(early: bool) -> None:
    """Rank 0's fold drops the changed tensor's call: it still joins the step's collective,
    its dropped call counted as rejected, so every rank raises (rank 0 its own reason)
    and resets nothing, as one process would; the next steps stay paired across ranks."""
    run = functools.partial(modified_on_one_rank, early=early)
    for rank, out in enumerate(ok_results(run_ranks(run, 2, timeout=120))):
        assert out[0] == ("ModifiedInputError" if rank == 0 else "RejectedInputError"), out
        # step 0's rest (both n, rank 1's x) merges into step 1, as compute() again would
        assert out[1] == {"n": 4.0, "x": pytest.approx(5 / 3)}, out
        assert out[2] == {"n": 2.0, "x": 1.5}, out


def test_a_grouped_tensor_changed_in_place_on_one_rank_keeps_the_ranks_in_step() -> None:
    """With ``by=`` the dropped call's metrics are not known before the split: rank 0
    joins the step's collective, then raises; the peers' result lacks its call."""
    outs = ok_results(run_ranks(functools.partial(modified_on_one_rank, by=True), 2, timeout=120))
    assert outs[0][0] == "ModifiedInputError", outs
    assert outs[1][0] == {"n": 2.0, "x/a": 2.0}, outs
    for out in outs:
        assert out[1:] == [{"n": 2.0, "x/a": 1.5}] * 2, out


COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "broadcast",
    "all_to_all",
    "reduce_scatter",
    "gather",
    "scatter",
    "reduce",
    "barrier",
    "all_gather_into_tensor",
    "broadcast_object_list",
    "all_gather_single",
)


def count_collectives(rank: int, world: int, num_metrics: int, limit: int | None) -> list[int]:
    """Collectives per compute() for steps 1-3 (steady state from step 2); ``limit``
    replaces rd.GATHER_LIMIT (0: the all_reduce pair, whatever the size). Over a new
    group of every rank: nothing agreed over it yet, as in a fresh process."""
    group = tdist.new_group(list(range(world)))
    counts = {"n": 0}
    with pytest.MonkeyPatch.context() as patch:
        if limit is not None:
            patch.setattr(rd, "GATHER_LIMIT", limit)
        for name in COLLECTIVES:
            original = getattr(tdist, name, None)
            if original is None:  # all_gather_single: new in torch 2.13
                continue

            def wrapped(*args, _original=original, **kwargs):
                counts["n"] += 1
                return _original(*args, **kwargs)

            patch.setattr(tdist, name, wrapped)
        kinds = ("mean", "sum", "max", "min", "last")
        tracker = Tracker()
        per_step = []
        for step in range(3):
            for i in range(num_metrics):
                kind = kinds[i % len(kinds)]
                value = torch.tensor(float(step + i)) if i % 2 else float(step + i)
                getattr(tracker, kind)(f"metric_{i}", value)
            before = counts["n"]
            tracker.compute(group=group)
            per_step.append(counts["n"] - before)
    return per_step


LIMITS = {"one_gather": None, "all_reduce_pair": 0}


@pytest.mark.parametrize("num_metrics", [20, 200])
@pytest.mark.parametrize(
    ("route", "per_step"), [("one_gather", 1), ("all_reduce_pair", 2)], ids=list(LIMITS)
)
def test_steady_state_collectives(
    two_ranks: Session, num_metrics: int, route: str, per_step: int
) -> None:
    """One all_gather per step below rd.GATHER_LIMIT, all_reduce(SUM) + all_reduce(MAX)
    above it; however many metrics."""
    per_rank = ok_results(two_ranks[f"collectives/{route}/{num_metrics}"])
    for first, second, third in per_rank:
        assert second == third == per_step
        assert first == 2 + per_step  # agreement (2 byte gathers), then the reduce


def nan_in_max(rank: int, world: int) -> dict:
    tracker = Tracker()
    # gloo's MAX keeps whichever operand comes first when one is NaN; rlmetrics must not.
    tracker.max("nan_on_rank1", torch.tensor([1.0, math.nan]) if rank == 1 else 5.0)
    tracker.max("nan_on_rank0", math.nan if rank == 0 else 1.0)
    tracker.min("finite", float(rank))
    return tracker.compute()


def test_nan_propagates_through_max_on_every_rank(two_ranks: Session) -> None:
    for result in ok_results(two_ranks["nan_in_max"]):
        assert math.isnan(result["nan_on_rank1"]) and math.isnan(result["nan_on_rank0"])
        assert result["finite"] == 0.0


def rejected_reasons(rank: int, world: int) -> tuple[str, dict]:
    """Under ``nonfinite="error"``, rank 0 logs a NaN value and rank 1 a negative weight
    to one metric: every rank's error counts both calls, each with its reason; the
    step's other calls come back at the next compute()."""
    tracker = Tracker(nonfinite="error")
    tracker.mean("ok", torch.tensor([1.0, 2.0 + rank]))
    if rank == 0:
        tracker.mean("loss", torch.tensor([1.0, math.nan]))
    else:
        tracker.mean("loss", torch.tensor([1.0, 2.0]), weight=torch.tensor([1.0, -1.0]))
    try:
        tracker.compute(timeout=30)
    except RejectedInputError as error:
        return str(error), tracker.compute(timeout=30)
    raise AssertionError("no RejectedInputError")


def test_a_rejected_calls_reason_is_counted_over_every_rank(two_ranks: Session) -> None:
    for message, after in ok_results(two_ranks["rejected_reasons"]):
        assert "'loss' (mean): 2 (1 with a non-finite value, 1 with a negative or " in message
        assert "'ok'" not in message
        assert after == {"ok": 1.75}  # (1 + 2 + 1 + 3) / 4


def both_paths_tracker(rank: int, world: int, seed: int, dyadic: bool) -> Tracker:
    """Every kind (random shares and micro-batches), NaN and inf on some ranks. With
    ``dyadic`` the values are multiples of 1/1024 below 2**10 in magnitude, so every sum
    is exact in float64, in any order."""
    batch = make_batch(seed, 37)
    if dyadic:
        batch["value"] = np.random.default_rng(seed + 100).integers(-(2**20), 2**20, 37) / 1024
    rng = np.random.default_rng(seed + 1)  # the same split on every rank
    shares = split(rng, rng.permutation(37), world)
    tracker = Tracker()
    for piece in split(np.random.default_rng(seed + 2 + rank), shares[rank], 4):
        log_every_kind(tracker, batch, piece)
    tracker.max("nan/max", torch.tensor([1.0, math.nan]) if rank == 1 else 5.0)
    tracker.min("nan/min", math.nan if rank == 0 else 1.0)
    tracker.mean("inf/mean", torch.tensor([1.0, math.inf if rank == world - 1 else 2.0]))
    return tracker


def both_paths(rank: int, world: int) -> list[tuple[dict, dict, TrackerState]]:
    """Per data set: (gather-path result, all_reduce-path result, this rank's state)."""
    gather_limit = rd.GATHER_LIMIT
    out = []
    for seed in range(3):
        for dyadic in (False, True):
            results = []
            for limit in (gather_limit, 0):
                with pytest.MonkeyPatch.context() as patch:
                    patch.setattr(rd, "GATHER_LIMIT", limit)
                    tracker = both_paths_tracker(rank, world, seed, dyadic)
                    results.append(tracker.compute(timeout=30))
            out.append((*results, both_paths_tracker(rank, world, seed, dyadic).state()))
    return out


def same_bits(a: dict, b: dict) -> bool:
    """Same keys in the same order, every value the same float64 (NaN equals NaN)."""
    return list(a) == list(b) and all(
        (math.isnan(a[k]) and math.isnan(b[k]))
        or struct.pack("<d", a[k]) == struct.pack("<d", b[k])
        for k in a
    )


@pytest.mark.parametrize("world", [2, 3])
def test_gather_and_all_reduce_paths_agree(world: int, request: pytest.FixtureRequest) -> None:
    """Both paths give the same result on every rank, for every kind. Two ranks and exact
    (dyadic) values: bit for bit. Three ranks and random values: the all_reduce adds in
    its own order, so equal to rounding. The gather path adds in rank order, so it is
    bit for bit the driver merge of the ranks' states in rank order (rlmetrics.integrations.ray)."""
    per_rank = ok_results(ranks(request, world)["both_paths"])
    for case, runs in enumerate(zip(*per_rank, strict=True)):
        gathered, reduced, _ = runs[0]
        dyadic = case % 2 == 1
        assert "m/dist/p99" in gathered and "sometimes" in gathered
        assert math.isnan(gathered["nan/max"]) and math.isnan(gathered["nan/min"])
        assert gathered["inf/mean"] == math.inf
        for other_gathered, other_reduced, _ in runs[1:]:  # every rank: the same bits
            assert same_bits(other_gathered, gathered) and same_bits(other_reduced, reduced)
        if world == 2 or dyadic:
            assert same_bits(gathered, reduced), case
        else:
            assert list(gathered) == list(reduced)
            for key, value in reduced.items():
                assert math.isclose(gathered[key], value, rel_tol=1e-12) or (
                    math.isnan(gathered[key]) and math.isnan(value)
                ), key
        driver = TrackerState.merge_all([state for _, _, state in runs]).compute()
        assert same_bits(gathered, driver), case


# Per step, per rank: (name, kind, value) log calls. Steps repeat a schema (the cached
# packing plan), reorder it, add a name on one rank, change a name's kind, count a
# non-finite element and log a CPU tensor down the tensor path.
STEPS: list[list[list[tuple[str, str, object]]]] = [
    [[("a", "mean", 1.0), ("b", "max", 2.0)], [("a", "mean", 3.0), ("b", "max", -1.0)]],
    [[("a", "mean", 5.0), ("b", "max", 0.5)], [("a", "mean", 7.0), ("b", "max", 4.0)]],
    [[("b", "max", 1.5), ("a", "mean", 2.0)], [("a", "mean", 4.0), ("b", "max", 3.0)]],
    [[("a", "mean", 1.0)], [("a", "mean", 2.0), ("c", "sum", 6.0)]],
    [[("a", "max", 9.0), ("b", "max", 1.0)], [("a", "max", 8.0), ("b", "max", 2.0)]],
    [[("a", "mean", math.nan)], [("a", "mean", 2.0), ("b", "last", 0.5)]],
    [[("a", "mean", torch.tensor([1.0, 2.0]))], [("a", "mean", 3.0), ("b", "max", 1.0)]],
    [[("a", "mean", 1.0), ("b", "max", 2.0)], [("a", "mean", 3.0), ("b", "max", -1.0)]],
    [[("a", "mean", 1.0)], [("a", "mean", 2.0)]],  # the same plan three times: plain,
    [[("a", "mean", math.nan)], [("a", "mean", 2.0)]],  # with a count,
    [[("a", "mean", 3.0)], [("a", "mean", 5.0)]],  # plain again
]


def log_step(tracker: Tracker, calls: list[tuple[str, str, object]]) -> None:
    for name, kind, value in calls:
        tracker.log(name, value, kind=kind)


def changing_steps(rank: int, world: int) -> list[dict]:
    tracker = Tracker(nonfinite="skip")
    # tensors take the tensor path (device parts) on the CPU
    tracker.reduce_host_data_with_numpy = False
    outs = []
    for step in STEPS:
        log_step(tracker, step[rank])
        outs.append(tracker.compute(timeout=30))
    return outs


def test_steps_that_reuse_reorder_and_change_their_metrics(two_ranks: Session) -> None:
    """Each step equals one process logging every rank's calls: a step whose
    metric records are the last step's (the cached plan) and every kind of change."""
    per_rank = ok_results(two_ranks["changing_steps"])
    assert per_rank[0] == per_rank[1]
    for got, step in zip(per_rank[0], STEPS, strict=True):
        single = Tracker(nonfinite="skip")
        single.reduce_host_data_with_numpy = False
        for calls in step:
            log_step(single, calls)
        assert got == single.compute(), step


# -- the shared groups -----------------------------------------------------------------
Session = dict[str, dict[int, tuple[str, Any]]]


@pytest.fixture(scope="module")
def two_ranks() -> Session:
    collectives = {
        f"collectives/{route}/{num}": (count_collectives, (num, limit))
        for route, limit in LIMITS.items()
        for num in (20, 200)
    }
    calls = {
        **collectives,
        "partitions": (run_many_partitions, ()),
        "kind_conflict": (kind_conflict, ()),
        "configured_differently": (configured_differently, ()),
        "nan_in_max": (nan_in_max, ()),
        "rejected_reasons": (rejected_reasons, ()),
        "both_paths": (both_paths, ()),
        "changing_steps": (changing_steps, ()),
    }
    return run_together(calls, 2, timeout=600)


@pytest.fixture(scope="module")
def three_ranks() -> Session:
    calls = {"empty_and_partial": (empty_and_partial_ranks, ()), "both_paths": (both_paths, ())}
    return run_together(calls, 3, timeout=600)


@pytest.fixture(scope="module")
def four_ranks() -> Session:
    calls = {
        "partitions": (run_many_partitions, ()),
        "subgroups": (subgroups, ()),
        "device_mesh": (device_mesh, ()),
    }
    return run_together(calls, 4, timeout=600)


def ranks(request: pytest.FixtureRequest, world: int) -> Session:
    """The shared group of ``world`` ranks."""
    return request.getfixturevalue({2: "two_ranks", 3: "three_ranks", 4: "four_ranks"}[world])
