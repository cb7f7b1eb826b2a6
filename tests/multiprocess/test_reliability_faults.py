"""Faults across real gloo ranks: deaths, hangs, odd name sets, kind clashes, new groups.

Every case ends in an exact result or, within the timeout, in an error on every
surviving rank that says what happened; no value is ever attributed to the wrong metric.
"""

from __future__ import annotations

import gc
import hashlib
import os
import pickle
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as tdist

from rlmetrics import SyncTimeoutError, Tracker
from rlmetrics._engine import sync as rd

from gloo_ranks import free_port, ok_results, run_ranks, run_together

TIMEOUT = 3.0  # seconds a survivor waits before SyncTimeoutError
SLACK = 5.0  # process and gloo overhead allowed on a shared 2-core machine


def exit_on_call(patch: pytest.MonkeyPatch, collective: str, n: int) -> None:
    """Make this process die (os._exit) on its ``n``-th call of ``dist.<collective>``."""
    original = getattr(tdist, collective)
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            os._exit(3)
        return original(*args, **kwargs)

    patch.setattr(tdist, collective, wrapped)


# -- a rank dies in the middle of a step -----------------------------------------------------
def killed_mid_step(rank: int, world: int, collective: str, n: int, limit: int | None) -> tuple:
    """Step 1 agrees the schema; rank 1 then dies before its ``n``-th call of
    ``dist.<collective>`` in step 2. A new name forces re-agreement, so step 2 issues the
    state gather (which raises the "schema changed" flag), the two schema gathers
    (length, then bytes) and the state gather again; with ``limit=0`` (rd.GATHER_LIMIT)
    the states travel by all_reduce(SUM), then all_reduce(MAX)."""
    with pytest.MonkeyPatch.context() as patch:
        if limit is not None:
            patch.setattr(rd, "GATHER_LIMIT", limit)
        tracker = Tracker()
        tracker.mean("x", float(rank))
        tracker.sum("n", 1.0)
        assert tracker.compute(timeout=30) == {"x": 0.5, "n": 2.0}
        if rank == 1:
            exit_on_call(patch, collective, n)
        tracker.mean("x", 10.0 + rank)
        tracker.sum("n", torch.ones(3))
        tracker.max("new_name", 7.0)  # not in the cached schema: the flag forces agreement
        start = time.monotonic()
        try:
            tracker.compute(timeout=TIMEOUT)
        except SyncTimeoutError as error:
            elapsed = time.monotonic() - start
            # nothing was reset: the step's local metrics are all still there
            return elapsed, str(error), tracker.compute(sync=False)
    raise AssertionError("compute() returned although rank 1 died")


@pytest.mark.parametrize(
    ("collective", "n", "limit", "what"),
    [
        # counted from step 2, all_gather: states, schema length, schema bytes, states
        ("all_gather", 2, None, "schema length gather"),
        ("all_gather", 3, None, "schema gather"),
        ("all_gather", 4, None, "all_gather of metric states"),
        ("all_reduce", 2, 0, "all_reduce(MAX) of metric states"),  # SUM, then MAX
    ],
    ids=[
        "between_state_and_schema_gathers",
        "between_schema_gathers",
        "between_schema_and_state_gathers",
        "between_sum_and_max",
    ],
)
def test_rank_killed_between_two_collectives(
    collective: str, n: int, limit: int | None, what: str
) -> None:
    outcome = run_ranks(killed_mid_step, 2, collective, n, limit, allow_missing=(1,), timeout=90)
    assert 1 not in outcome
    status, result = outcome[0]
    assert status == "ok", result
    elapsed, message, local = result
    assert elapsed < TIMEOUT + SLACK
    assert f"{what} did not complete" in message and "a rank may have died" in message
    assert "Connection" in message  # gloo's reason: closed or reset by the dead peer
    assert local == {"x": 10.0, "n": 3.0, "new_name": 7.0}


# -- a rank hangs --------------------------------------------------------------------------
def hanging_rank(rank: int, world: int, flag: str) -> tuple:
    tracker = Tracker()
    tracker.mean("x", 1.0)
    assert tracker.compute(timeout=30) == {"x": 1.0}
    tracker.mean("x", 2.0)
    if rank == 1:  # hangs before compute() until rank 0 is done, then vanishes
        deadline = time.monotonic() + 60
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)
    start = time.monotonic()
    try:
        tracker.compute(timeout=timedelta(seconds=2))
    except SyncTimeoutError as error:
        return time.monotonic() - start, str(error), tracker.compute(sync=False)
    finally:
        Path(flag).touch()
    raise AssertionError("compute() returned although rank 1 hangs")


def test_hanging_rank_gives_timeout_error_within_the_timeout(tmp_path: Path) -> None:
    outcome = run_ranks(hanging_rank, 2, str(tmp_path / "done"), allow_missing=(1,), timeout=90)
    status, result = outcome[0]
    assert status == "ok", result
    elapsed, message, local = result
    assert 1.5 <= elapsed < 2.0 + SLACK
    assert "all_gather of metric states did not complete within 2 s" in message
    assert "timed out" in message and "hung" in message
    assert local == {"x": 2.0}


# -- name sets that differ per rank and per step, values that encode their names -----------
KINDS = ("mean", "sum", "max", "min", "std", "last", "dist")
NAMES = (
    [f"enc/{i:03d}" for i in range(240)]
    + [f"ünï/ß/{i}" for i in range(20)]
    + [f"指标/{i}" for i in range(20)]
    + [f"emoji/🚀/{i}" for i in range(10)]
    + ["long/" + "x" * 3000, 'quote"s\\and/sl/ash', "sp ace", "tab\tname"]
)
STEPS = 10
WORLD = 3
EMPTY_STEPS = {2: 2, 6: 1}  # step -> a rank that logs nothing that step


def code(name: str) -> float:
    """A number derived from the name alone: a multiple of 1/1024 below 2**30, so every
    sum, weighted mean and merge of copies of it is exact in float64."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") % 2**40) / 1024


def kind_of(name: str) -> str:
    return KINDS[int(hashlib.blake2b(name.encode(), digest_size=2).hexdigest(), 16) % len(KINDS)]


def plan(step: int, rank: int) -> list[tuple[str, str, int, int, int]]:
    """(name, kind, form, copies, weight) logged by ``rank`` in ``step``. Every third step
    draws from step-1's names only (the cached schema is reused, some names vanish)."""
    if EMPTY_STEPS.get(step) == rank:
        return []
    rng = np.random.default_rng([step, rank])
    pool = NAMES
    if step % 3 == 1:
        pool = sorted({p[0] for r in range(WORLD) for p in plan(step - 1, r)})
    chosen = [name for name in pool if rng.random() < 0.5]
    draws = rng.integers((0, 1, 1), (3, 4, 5), size=(len(chosen), 3))
    return [(name, kind_of(name), *map(int, row)) for name, row in zip(chosen, draws, strict=True)]


def log_plan(tracker: Tracker, entries: list[tuple[str, str, int, int, int]]) -> None:
    """Log each entry as a python float (form 0), a float64 tensor (1) or a float32
    tensor with weights (2): always ``copies`` copies of the name's code."""
    for name, kind, form, copies, weight in entries:
        value = code(name)
        weighted = kind in ("mean", "std")
        for _ in range(copies if form == 0 else 1):
            if form == 0:
                tracker.log(name, value, float(weight) if weighted else None, kind=kind)
            elif kind == "last":
                tracker.last(name, torch.tensor(value, dtype=torch.float64))
            else:
                values = torch.full((copies,), value, dtype=torch.float64)
                weights = torch.full((copies,), float(weight)) if weighted else None
                tracker.log(name, values, weights, kind=kind)


def expected_step(step: int) -> dict[str, float]:
    """Each metric's value from its name's code (and element count for sums)."""
    counts: dict[str, int] = {}
    for rank in range(WORLD):
        for name, kind, _form, copies, _ in plan(step, rank):
            counts[name] = counts.get(name, 0) + (1 if kind == "last" else copies)
    out: dict[str, float] = {}
    for name, count in counts.items():
        kind, value = kind_of(name), code(name)
        if kind == "dist":
            for suffix in ("mean", "min", "max", "p50", "p90", "p99"):
                out[f"{name}/{suffix}"] = value
            out[f"{name}/std"] = 0.0
        else:
            out[name] = {"sum": value * count, "std": 0.0}.get(kind, value)
    return out


def changing_names(rank: int, world: int) -> dict:
    """Both empty policies, every step; then a kind clash in a later step, and recovery."""
    omit, nan = Tracker(), Tracker(empty="nan")
    steps = []
    for step in range(STEPS):
        log_plan(omit, plan(step, rank))
        log_plan(nan, plan(step, rank))
        steps.append((omit.compute(timeout=30), nan.compute(timeout=30)))
    # a name logged with two kinds, first in the cached schema, then a new one
    clashes = []
    for name in ("enc/000", "brand_new"):
        omit.sum("ok", 1.0)
        omit.log(name, 1.0, kind="max" if rank == 1 else "min")
        try:
            omit.compute(timeout=30)
            clashes.append("no error")
        except ValueError as error:
            clashes.append(str(error))
        omit.reset()
    omit.mean("after", float(rank))
    return {"steps": steps, "clashes": clashes, "after": omit.compute(timeout=30)}


@pytest.fixture(scope="module")
def three_ranks() -> dict[str, dict]:
    """One spawned group of WORLD ranks: the changing name sets, then ranks 0 and 1
    alone (``only_mine``)."""
    calls = {"names": (changing_names, ()), "only_mine": (only_mine_on_two, ())}
    return run_together(calls, WORLD, timeout=300)


@pytest.fixture(scope="module")
def names_run(three_ranks: dict[str, dict]) -> list[dict]:
    return ok_results(three_ranks["names"])


def test_name_sets_change_per_rank_and_step_and_every_value_encodes_its_name(
    names_run: list[dict],
) -> None:
    assert len({code(n) for n in NAMES}) == len(NAMES)
    for step in range(STEPS):
        expected = expected_step(step)
        for per_rank in names_run:
            omit, nan = per_rank["steps"][step]
            assert omit == expected, step
            assert nan == expected, step  # nothing logged-but-empty: no NaN keys either
    assert any(EMPTY_STEPS.get(s) == r for s in range(STEPS) for r in range(WORLD))


def test_a_rank_with_no_micro_batches_for_a_whole_step(names_run: list[dict]) -> None:
    for step, empty_rank in EMPTY_STEPS.items():
        expected = expected_step(step)
        assert expected, "the other ranks logged"
        assert names_run[empty_rank]["steps"][step][0] == expected


def test_kind_disagreement_raises_on_every_rank_naming_kinds_and_ranks(
    names_run: list[dict],
) -> None:
    for per_rank in names_run:
        for name, message in zip(("enc/000", "brand_new"), per_rank["clashes"], strict=True):
            assert f"metric {name!r} is kind 'min' on rank 0 but kind 'max' on rank 1" in message
        assert per_rank["after"] == {"after": 1.0}  # the group keeps working afterwards


def only_mine_on_two(rank: int, world: int) -> list[dict] | None:
    """``only_mine`` over a group of ranks 0 and 1 (every rank must create it)."""
    group = tdist.new_group([0, 1])
    return only_mine(rank, group) if rank < 2 else None


def only_mine(rank: int, group: tdist.ProcessGroup) -> list[dict]:
    """Every step each rank also logs a name that no other rank has."""
    tracker = Tracker()
    outs = []
    for step in range(10):
        tracker.mean("shared/loss", float(step + rank), weight=float(rank + 1))
        tracker.sum("shared/tokens", torch.tensor([float(step), float(rank)]))
        tracker.max(f"rank{rank}/only", float(100 * rank + step))
        if rank == 1:
            tracker.dist("rank1/dist", torch.arange(step + 1.0))
            tracker.std("rank1/std", torch.tensor([step, step + 2.0]))
        tracker.last("lr", 1e-3 * (step + 1))
        outs.append(tracker.compute(group=group, timeout=30))
    return outs


def test_a_rank_logs_a_metric_no_other_rank_has_every_step(three_ranks: dict[str, dict]) -> None:
    per_rank = ok_results(three_ranks["only_mine"])
    assert per_rank[2] is None  # not in the group
    assert per_rank[0] == per_rank[1]
    for step, out in enumerate(per_rank[0]):
        values = np.arange(step + 1.0)
        expected = {
            "shared/loss": (step * 1 + (step + 1) * 2) / 3,
            "shared/tokens": float(2 * step + 1),
            "rank0/only": float(step),
            "rank1/only": float(100 + step),
            "rank1/std": 1.0,
            "lr": 1e-3 * (step + 1),
            "rank1/dist/mean": float(values.mean()),
            "rank1/dist/std": float(values.std()),
            "rank1/dist/min": 0.0,
            "rank1/dist/max": float(step),
        }
        for q in (0.5, 0.9, 0.99):
            expected[f"rank1/dist/p{round(q * 100, 6):g}"] = float(np.quantile(values, q))
        assert out == expected, step


# -- a process group re-created after a failure --------------------------------------------
def count_agreements(patch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count schema agreements on this rank (rlmetrics._engine.sync.agree_schema) until
    ``patch`` is undone."""
    calls = {"n": 0}
    original = rd.agree_schema

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    patch.setattr(rd, "agree_schema", wrapped)
    return calls


def recreated_group(rank: int, world: int, port: int) -> dict:
    """Rank 2 dies mid-step; 0 and 1 time out, re-create the world on a new port and
    compute the same step again; then new subgroups are created and destroyed in turn
    (ids may be reused) and each must agree its schema afresh."""
    with pytest.MonkeyPatch.context() as patch:
        tracker = Tracker()
        tracker.mean("x", float(rank))
        tracker.max(f"rank{rank}", 1.0)
        tracker.compute(timeout=30)
        if rank == 2:
            exit_on_call(patch, "all_gather", 1)  # the state gather ("n" is new: no agreement yet)
        tracker.mean("x", 10.0 * (rank + 1))
        tracker.sum("n", 1.0)
        try:
            tracker.compute(timeout=TIMEOUT)
            raise AssertionError("compute() returned although rank 2 died")
        except SyncTimeoutError:
            pass
        tdist.destroy_process_group()
        gc.collect()
        tdist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=30),
        )
        agreements = count_agreements(patch)
        retried = tracker.compute(timeout=30)  # the step's metrics survived the failure
        new_world = agreements["n"]
        outs, ids = [], []
        for cycle in range(8):
            group = tdist.new_group([0, 1])
            ids.append(id(group))
            before = agreements["n"]
            # a name set that fits the previous cycle's layout on rank 1 only: a stale
            # layout found by a reused id would send rank 1 to the reduce, rank 0 to agree
            tracker.mean("y", float(cycle + rank))
            if rank == 0:
                tracker.sum(f"cycle{cycle}", 1.0)
            outs.append((tracker.compute(group=group, timeout=30), agreements["n"] - before))
            tdist.destroy_process_group(group)
            del group
            gc.collect()
        return {
            "retried": retried,
            "new_world_agreements": new_world,
            "cycles": outs,
            "reused_ids": len(ids) - len(set(ids)),
            "cache_size": len(tracker._plan.group_syncs),
            "pickled_cache": len(pickle.loads(pickle.dumps(tracker))._plan.group_syncs),
        }


def test_group_recreated_after_a_failure_never_reuses_a_stale_schema() -> None:
    outcome = run_ranks(recreated_group, 3, free_port(), allow_missing=(2,), timeout=120)
    assert 2 not in outcome
    per_rank = ok_results(outcome)
    for result in per_rank:
        assert result["retried"] == {"x": 15.0, "n": 2.0}
        assert result["new_world_agreements"] == 1
        for cycle, (out, agreements) in enumerate(result["cycles"]):
            assert out == {"y": cycle + 0.5, f"cycle{cycle}": 1.0}
            assert agreements == 1  # a new group: agreed afresh, never a cached layout
        assert result["cache_size"] <= 1  # destroyed groups leave the cache
        assert result["pickled_cache"] == 0  # a pickled tracker carries no groups
