"""Rank-aware timings and throughput: slowest rank, mean, min, which rank; exact.

Timings run on real gloo groups of 2 and 4 spawned ranks with an injected clock (exact,
known durations per rank, compared with ``==`` against numpy on the whole table) and
with real sleeps (tolerances). Throughput is Σ tokens / the slowest rank's time, never a
mean of per-rank rates. Merges in any order give the same state; CUDA events are read
at step end only (an injected event factory here; real events where a GPU is visible).
"""

from __future__ import annotations

import itertools
import math
import pickle
import random
import re
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmetrics import RejectedInputError, Tracker, TrackerState, get_kind, rl, unregister_kind
from rlmetrics.kinds.rank_time import family_kind
from rlmetrics.timing import timer

from gloo_ranks import ok_results, run_together
from helpers import merge_trackers, run_python

# each rank's entries into "gen" (seconds, dyadic: every sum is exact); rank 3 skips it
GEN = ([0.5, 0.25], [1.5], [0.125, 0.125, 0.75], [])
REWARD = (0.25, 0.0, 2.0, 0.5)  # one entry each, logged with elapsed(); 0 s counts
TOKENS = (107.0, 207.0, 307.0, 407.0)
STEP = (3.0, 4.0, 2.5, 1.0)
SLEEP = (0.05, 0.25, 0.45, 0.65)  # the real-sleep test's per-rank sleeps


def clock_for(durations: list[float]) -> Callable[[], float]:
    """A clock whose successive (enter, exit) readings are ``durations`` apart."""
    readings = [(100.0 + 8 * i, 100.0 + 8 * i + d) for i, d in enumerate(durations)]
    return iter(itertools.chain.from_iterable(readings)).__next__


def expected_timing(per_rank: dict[int, float]) -> dict[str, float]:
    """The four keys from each present rank's total, with numpy."""
    ranks = np.array(list(per_rank))
    totals = np.array(list(per_rank.values()))
    return {
        "": totals.max(),
        "/mean": totals.mean(),
        "/min": totals.min(),
        "/slowest_rank": float(ranks[np.argmax(totals)]),
    }


def expected(world: int) -> dict[str, float]:
    """What every rank's synced compute() must return, from the tables above."""
    out: dict[str, float] = {}
    gen = {r: float(np.sum(GEN[r])) for r in range(world) if GEN[r]}
    reward = {r: REWARD[r] for r in range(world)}
    for name, per_rank in (("timing_s/gen", gen), ("timing_s/reward", reward)):
        out |= {name + k: v for k, v in expected_timing(per_rank).items()}
    total = np.sum(TOKENS[:world]) / np.max(STEP[:world])
    out["perf/throughput"] = total / world
    out["perf/throughput/total"] = total
    return out


# -- functions run on every rank -------------------------------------------------------------
def injected_clock(rank: int, world: int) -> tuple[dict, dict, dict]:
    """Synced results, this rank's sync=False results, and a subgroup's results."""
    t = Tracker()
    if GEN[rank]:  # the last of 4 ranks never enters gen
        with t.prefixed("timing_s/").timer("gen", clock=clock_for(GEN[rank][:1])):
            pass
    for d in GEN[rank][1:]:
        t.elapsed("timing_s/gen", d)  # entries measured elsewhere add up
    t.elapsed("timing_s/reward", REWARD[rank])
    t.throughput("perf/throughput", TOKENS[rank], STEP[rank])
    synced = t.compute(timeout=30)
    t.elapsed("timing_s/reward", REWARD[rank])
    local = t.compute(sync=False)
    members = sorted({1, world - 1})  # its rank 0 is the world's rank 1
    sub = dist.new_group(members)
    sub_out = {}
    if rank in members:
        t.elapsed("timing_s/reward", REWARD[rank], group=sub)
        sub_out = t.compute(group=sub, timeout=30)
    return synced, local, sub_out


def real_sleeps(rank: int, world: int) -> dict:
    t = Tracker()
    with t.timer("timing_s/sleep"):
        time.sleep(SLEEP[rank])
    return t.compute(timeout=60)


def steady_collectives(rank: int, world: int) -> list[int]:
    """Collectives per step over a fresh group: timings add none of their own."""
    group = dist.new_group(list(range(world)))
    counts = {"n": 0}
    with pytest.MonkeyPatch.context() as patch:
        for op in ("all_gather", "all_reduce"):
            original = getattr(dist, op)

            def wrapped(*args, _original=original, **kwargs):
                counts["n"] += 1
                return _original(*args, **kwargs)

            patch.setattr(dist, op, wrapped)
        t, out = Tracker(), []
        for _ in range(3):
            t.mean("loss", 1.0)
            t.elapsed("timing_s/gen", 0.5 * rank, group=group)
            t.throughput("perf/throughput", 10.0, 1.0 + rank, group=group)
            before = counts["n"]
            t.compute(group=group, timeout=30)
            out.append(counts["n"] - before)
    return out


def bad_token_count(rank: int, world: int) -> tuple[str, str, dict, dict]:
    """Step 1: rank 1 logs a NaN tensor token count; step 2: every count is good. Every
    rank raises after step 1's collective (the ranks stay paired); a second compute()
    returns the step's other calls, then step 2 is exact."""
    t = Tracker()
    t.mean("loss", float(rank))
    bad = math.nan if rank == 1 else TOKENS[rank]
    t.throughput("perf/throughput", torch.tensor(bad), STEP[rank])
    try:
        t.compute(timeout=30)
        raised = ("", "")
    except ValueError as error:
        raised = (type(error).__name__, str(error))
    retry = t.compute(timeout=30)
    t.mean("loss", float(rank))
    t.throughput("perf/throughput", torch.tensor(TOKENS[rank]), STEP[rank])
    return (*raised, retry, t.compute(timeout=30))


CALLS = {
    "bad count": (bad_token_count, ()),
    "injected": (injected_clock, ()),
    "sleeps": (real_sleeps, ()),
    "collectives": (steady_collectives, ()),
}


@pytest.fixture(scope="module", params=[2, 4])
def session(request: pytest.FixtureRequest) -> tuple[int, dict]:
    return request.param, run_together(CALLS, request.param, timeout=300)


@pytest.mark.slow  # spawns gloo ranks (the session fixture)
def test_slowest_mean_min_and_rank_equal_numpy_on_every_rank(session) -> None:
    world, outcome = session
    results = ok_results(outcome["injected"])
    want = expected(world)
    for rank, (synced, local, _) in enumerate(results):
        assert synced == want, f"rank {rank}"
        own = {"": REWARD[rank], "/mean": REWARD[rank], "/min": REWARD[rank],
               "/slowest_rank": float(rank)}  # fmt: skip
        assert {k: local[f"timing_s/reward{k}"] for k in own} == own  # sync=False: its own


@pytest.mark.slow  # spawns gloo ranks (the session fixture)
def test_a_subgroup_numbers_its_own_ranks(session) -> None:
    world, outcome = session
    results = ok_results(outcome["injected"])
    members = sorted({1, world - 1})
    want = {f"timing_s/reward{k}": v for k, v in
            expected_timing({i: REWARD[r] for i, r in enumerate(members)}).items()}  # fmt: skip
    for rank in members:
        got = {k: v for k, v in results[rank][2].items() if k.startswith("timing_s/reward")}
        assert got == want


@pytest.mark.slow  # spawns gloo ranks (the session fixture)
def test_real_sleeps_find_the_slowest_rank(session) -> None:
    world, outcome = session
    for out in ok_results(outcome["sleeps"]):
        slept = SLEEP[:world]
        assert out["timing_s/sleep/slowest_rank"] == world - 1
        assert max(slept) <= out["timing_s/sleep"] < max(slept) + 0.15
        assert min(slept) <= out["timing_s/sleep/min"] < min(slept) + 0.15
        assert np.mean(slept) <= out["timing_s/sleep/mean"] < np.mean(slept) + 0.15


@pytest.mark.slow  # spawns gloo ranks (the session fixture)
def test_timings_ride_in_the_one_packed_collective(session) -> None:
    _, outcome = session
    for counts in ok_results(outcome["collectives"]):
        assert counts[1:] == [1, 1]  # after the first step's schema agreement


@pytest.mark.slow  # spawns gloo ranks (the session fixture)
def test_a_bad_tensor_token_count_on_one_rank_raises_on_every_rank(session) -> None:
    world, outcome = session
    want = {k: v for k, v in expected(world).items() if k.startswith("perf/")}
    want["loss"] = float(np.mean(range(world)))
    good = [r for r in range(world) if r != 1]
    total = np.sum([TOKENS[r] for r in good]) / np.max([STEP[r] for r in good])
    rest = {"loss": want["loss"], "perf/throughput": total / len(good)}
    rest["perf/throughput/total"] = total
    for rank, (error, message, retry, step_2) in enumerate(ok_results(outcome["bad count"])):
        if rank == 1:  # its own reason: the metric and the count
            assert error == "TokenCountError", message
            assert "'perf/throughput': num_tokens must be finite and >= 0, got nan" in message
        else:  # its peers': the metric's call was rejected on some rank
            assert error == "RejectedInputError" and "'perf/throughput'" in message, message
        assert retry == rest, f"rank {rank}"  # the step without the dropped call
        assert step_2 == want, f"rank {rank}"  # still paired


# -- throughput ------------------------------------------------------------------------------
def rank_states(tokens: list[float], seconds: list[float]) -> list[TrackerState]:
    world = len(tokens)
    states = []
    for rank, (n, s) in enumerate(zip(tokens, seconds, strict=True)):
        t = Tracker()
        t.throughput("perf/throughput", n, s, rank=rank, world_size=world)
        t.mean("old/throughput", n / s)  # the old figure: a mean of per-rank rates
        states.append(t.state())
    return states


def test_throughput_is_total_tokens_over_the_slowest_time_not_a_mean_of_rates() -> None:
    tokens, seconds = [600.0, 400.0, 100.0], [4.0, 2.0, 1.0]
    out = TrackerState.merge_all(rank_states(tokens, seconds)).compute()
    total = np.sum(tokens) / np.max(seconds)
    assert out["perf/throughput/total"] == total
    assert out["perf/throughput"] == total / 3
    rates = np.mean(np.array(tokens) / np.array(seconds))
    assert out["old/throughput"] == pytest.approx(rates)
    assert rates > 1.5 * out["perf/throughput"]  # the old drift: fast ranks inflate it
    balanced = TrackerState.merge_all(rank_states(tokens, [4.0] * 3)).compute()
    assert balanced["perf/throughput"] == pytest.approx(balanced["old/throughput"])


@pytest.mark.parametrize("bad", [-5.0, math.nan, math.inf, -math.inf])
def test_a_bad_tensor_token_count_raises_at_the_step_end_naming_metric_and_count(bad) -> None:
    """Read at the step's end (not at the call, nor at an early fold): the call is
    dropped, the error names the metric and the count, the step's other calls stay."""
    t = Tracker()
    t.record_limit = 0  # every log call folds early: the count waits for compute()
    t.mean("loss", 2.0)
    t.prefixed("perf/").throughput("tp", torch.tensor(bad), 2.0, rank=0, world_size=2)
    t.throughput("perf/tp", torch.tensor([30], dtype=torch.int32), 2.0, rank=1, world_size=2)
    t.mean("loss", 4.0)
    with pytest.raises(ValueError, match=rf"'perf/tp': num_tokens must be finite and >= 0, "
                       rf"got {re.escape(repr(bad))} \(a tensor count") as info:  # fmt: skip
        t.compute()
    assert info.value.calls == {"perf/tp": 1}  # in a sync: counted as rejected
    assert t.compute() == {"loss": 3.0, "perf/tp": 30 / 2.0 / 1, "perf/tp/total": 15.0}


def test_a_tensor_token_count_is_the_value_at_the_call() -> None:
    t, tokens = Tracker(), torch.tensor(40.0, dtype=torch.float64)
    t.throughput("tp", tokens, 2.0)
    tokens.fill_(-1.0)  # a reused buffer: the logged count is a copy
    assert t.compute() == {"tp": 20.0, "tp/total": 20.0}
    t.throughput("tp", torch.tensor(8.0), 2.0)
    t.reset()  # drops the count not read yet
    assert t.compute() == {}


@pytest.mark.parametrize("bad", [-5.0, math.nan, math.inf])
def test_perf_updates_reject_a_bad_tensor_token_count_at_the_step_end(bad) -> None:
    t = Tracker()
    t.mean("loss", 1.0)
    rl.log_updates(t, rl.perf_updates(torch.tensor(bad), 2.0))
    with pytest.raises(RejectedInputError, match="token count") as info:
        t.compute()
    assert "'perf/throughput'" in str(info.value)
    assert "'perf/total_num_tokens'" in str(info.value)
    assert t.compute() == {"loss": 1.0}


def test_throughput_sums_a_ranks_pieces_and_takes_device_tokens() -> None:
    t = Tracker()
    t.throughput("tp", torch.tensor(30.0), 1.0, rank=0, world_size=2)
    t.throughput("tp", torch.tensor([50], dtype=torch.int64), 2.0, rank=0, world_size=2)
    t.throughput("tp", 40.0, 2.5, rank=1, world_size=2)
    assert t.compute() == {"tp": 120.0 / 3.0 / 2, "tp/total": 40.0}


# -- exact under any merge -------------------------------------------------------------------
dyadic = st.integers(0, 64).map(lambda k: k / 16)


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 4),
    entries=st.lists(st.tuples(st.integers(0, 3), dyadic), max_size=12),
    seed=st.integers(0, 2**31),
)
def test_any_split_and_merge_order_gives_the_single_stream_state(world, entries, seed) -> None:
    entries = [(rank % world, s) for rank, s in entries]
    whole = Tracker()
    for rank, s in entries:
        whole.elapsed("t", s, rank=rank, world_size=world)
        whole.throughput("tp", 8.0 * rank + 1, s + 1.0, rank=rank, world_size=world)
    rnd = random.Random(seed)
    pieces = [Tracker() for _ in range(rnd.randint(1, 5))]
    for tracker in pieces:
        tracker.record_limit = rnd.choice((0, 3, 1 << 22))  # some fold mid-step
        # some reduce through the tensor path
        tracker.reduce_host_data_with_numpy = rnd.random() < 0.5
    for rank, s in entries:
        piece = rnd.choice(pieces)
        piece.elapsed("t", s, rank=rank, world_size=world)
        piece.throughput("tp", 8.0 * rank + 1, s + 1.0, rank=rank, world_size=world)
    got = merge_trackers(pieces, rnd).compute()
    assert got == whole.compute()
    per_rank: dict[int, float] = {}
    for rank, s in entries:
        per_rank[rank] = per_rank.get(rank, 0.0) + s
    if per_rank:  # and the timing keys equal numpy's on the per-rank totals
        want = {f"t{k}": v for k, v in expected_timing(dict(sorted(per_rank.items()))).items()}
        assert {k: got[k] for k in want} == want


# -- device timers: events read at step end --------------------------------------------------
class FakeEvents:
    """An event factory on a settable clock and one in-order stream, counting host
    waits; like CUDA's events, ``elapsed_time`` raises unless both events completed,
    and waiting for an event completes every event recorded before it."""

    def __init__(self) -> None:
        self.now, self.waits, self.recorded, self.completed = 0.0, 0, 0, 0

    def __call__(self) -> FakeEvents.Event:
        return FakeEvents.Event(self)

    def finish(self) -> None:
        """The device catches up with everything queued."""
        self.completed = self.recorded

    class Event:
        def __init__(self, stream: FakeEvents) -> None:
            self.stream, self.at, self.seq = stream, 0.0, math.inf

        def record(self) -> None:
            self.stream.recorded += 1
            self.at, self.seq = self.stream.now, self.stream.recorded

        def query(self) -> bool:
            return self.seq <= self.stream.completed

        def synchronize(self) -> None:
            if not self.query():
                self.stream.waits += 1
                self.stream.completed = max(self.stream.completed, self.seq)

        def elapsed_time(self, end: FakeEvents.Event) -> float:
            if not (self.query() and end.query()):
                raise RuntimeError("elapsed_time of an event that has not completed")
            return (end.at - self.at) * 1000.0


def test_device_timer_waits_only_at_step_end() -> None:
    events, t = FakeEvents(), Tracker()
    for duration in (0.375, 0.5):
        with t.prefixed("timing_s/").timer("fwd", events=events, rank=1, world_size=2):
            events.now += duration  # the device work, queued
    assert len(t.device_timers) == 2 and "timing_s/fwd" not in t
    t.record_limit = 0
    t.mean("loss", 1.0)  # a mid-step fold: unfinished events stay pending, no wait
    assert len(t.device_timers) == 2 and events.waits == 0
    out = t.compute()  # the host waits here
    assert events.waits == 2 and len(t.device_timers) == 0
    assert out["timing_s/fwd"] == 0.875 and out["timing_s/fwd/slowest_rank"] == 1.0


def test_device_timer_finished_events_are_read_at_a_mid_step_fold() -> None:
    events, t = FakeEvents(), Tracker()
    with timer(t, "x", events=events):
        events.now += 0.25
    events.finish()
    t.record_limit = 0
    t.mean("loss", 1.0)
    assert len(t.device_timers) == 0 and "x" in t and events.waits == 0
    pickle.dumps(t)  # nothing unpicklable left behind
    with timer(t, "x", events=events):
        events.now += 0.25
    t.reset()  # a new step: the unread timer goes with the rest
    assert len(t.device_timers) == 0 and t.compute() == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_timer_records_events_without_a_sync_and_reads_them_at_compute() -> None:
    t, x = Tracker(), torch.randn(1024, 1024, device="cuda")
    outer = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outer[0].record()
        with t.timer("timing_s/matmul", device="cuda"):
            for _ in range(50):
                x = torch.tanh(x @ x)
        outer[1].record()
        t.mean("x", x.mean())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out = t.compute()
    torch.cuda.synchronize()
    assert 0 < out["timing_s/matmul"] <= outer[0].elapsed_time(outer[1]) / 1000.0
    assert out["timing_s/matmul/slowest_rank"] == 0.0


# -- kinds, states, errors -------------------------------------------------------------------
@pytest.mark.slow  # a fresh interpreter
def test_a_fresh_process_merges_states_of_a_family_it_never_logged() -> None:
    t = Tracker()
    t.elapsed("t", 1.5, rank=2, world_size=3)
    blob = pickle.dumps(t.state()).hex()
    code = (
        "import pickle; from rlmetrics import TrackerState; "
        f"s = pickle.loads(bytes.fromhex({blob!r})); print(s.merge(s).compute())"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str({"t": 3.0, "t/mean": 3.0, "t/min": 3.0,
                                       "t/slowest_rank": 2.0})  # fmt: skip


def test_family_members_are_made_on_first_use_and_sized_by_the_group() -> None:
    unregister_kind("rank_time@5")
    kind = get_kind("rank_time@5")
    assert (kind.num_sums, kind.parts) == (10, 5) and get_kind("rank_time@5") is kind
    assert get_kind("rank_throughput@2").num_sums == 6
    assert family_kind("mean") is None and family_kind("rank_time") is None
    for bad in ("rank_time@0", "rank_time@x", "rank_time@01", "rank_time@-1"):
        with pytest.raises(ValueError, match="the 'rank_time' family takes the group's size"):
            get_kind(bad)


def test_state_dict_round_trip_keeps_the_ranks_apart() -> None:
    t = Tracker()
    t.elapsed("t", 1.0, rank=0, world_size=2)
    t.elapsed("t", 3.0, rank=1, world_size=2)
    back = Tracker()
    back.load_state_dict(t.state_dict())
    assert back.compute() == t.compute() == {"t": 3.0, "t/mean": 2.0, "t/min": 1.0,
                                             "t/slowest_rank": 1.0}  # fmt: skip


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda t: t.elapsed("t/a", -0.5), ValueError, "'t/a': seconds must be finite and >= 0"),
        (lambda t: t.elapsed("t/a", math.nan), ValueError, "'t/a': seconds must be finite"),
        (lambda t: t.elapsed("t/a", math.inf), ValueError, "'t/a': seconds must be finite"),
        (lambda t: t.elapsed("t/a", torch.tensor(1.0)), TypeError, "'t/a': seconds must be a"),
        (lambda t: t.elapsed("t/a", True), TypeError, "'t/a': seconds must be a"),
        (lambda t: t.elapsed("t/a", 1.0, rank=2, world_size=2), ValueError,
         r"'t/a': rank must be in \[0, world_size=2\), got 2"),
        (lambda t: t.elapsed("t/a", 1.0, rank=0), TypeError,
         "'t/a': pass rank= and world_size= together"),
        (lambda t: t.elapsed("t/a", 1.0, rank=0.0, world_size=2), TypeError,
         "'t/a': rank must be an int"),
        (lambda t: t.throughput("t/p", 5.0, 0.0), ValueError,
         "'t/p': seconds must be finite and > 0"),
        (lambda t: t.throughput("t/p", -5.0, 1.0), ValueError,
         r"'t/p': num_tokens must be finite and >= 0, got -5\.0"),
        (lambda t: t.throughput("t/p", math.nan, 1.0), ValueError,
         "'t/p': num_tokens must be finite and >= 0, got nan"),
        (lambda t: t.throughput("t/p", np.float64(math.inf), 1.0), ValueError,
         r"'t/p': num_tokens must be finite and >= 0, got np\.float64\(inf\)"),
        (lambda t: t.throughput("t/p", "5", 1.0), TypeError, "'t/p': num_tokens must be a"),
        (lambda t: t.throughput("t/p", torch.tensor(5.0), -1.0), ValueError,
         "'t/p': seconds must be finite and > 0"),
        (lambda t: t.throughput("t/p", torch.ones(2), 1.0), ValueError,
         r"'t/p': num_tokens must hold one number, got a tensor of shape \(2,\)"),
        (lambda t: t.log("t/a", [1.0, 2.0, 3.0], kind="rank_time@2"), TypeError,
         "'t/a' .* splits each call into 2 equal parts"),
        # a python int beyond float64, as a log call's (was a bare OverflowError)
        (lambda t: t.elapsed("t/a", 10**400), ValueError,
         "'t/a': seconds is out of float64's range"),
        (lambda t: t.throughput("t/p", 10**400, 1.0), ValueError,
         "'t/p': num_tokens is out of float64's range"),
        (lambda t: t.throughput("t/p", torch.tensor(5.0), 10**400), ValueError,
         "'t/p': seconds is out of float64's range"),
        # a bool or complex tensor count, as a python bool (was: tensor(True) as 1 token)
        (lambda t: t.throughput("t/p", torch.tensor(True), 1.0), TypeError,
         "'t/p': num_tokens must be a real number, got a tensor of dtype torch.bool"),
        (lambda t: t.throughput("t/p", torch.tensor(1 + 1j), 1.0), TypeError,
         "'t/p': num_tokens must be a real number, got a tensor of dtype torch.complex"),
    ],
)  # fmt: skip
def test_errors_name_the_metric(call, error, match) -> None:
    """Each bad argument raises at the call naming the metric; nothing is logged."""
    t = Tracker()
    with pytest.raises(error, match=match):
        call(t)
    assert t.compute() == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_timing_without_cuda_names_the_metric() -> None:
    match = "'t/g': device='cuda' timing needs CUDA"
    with pytest.raises(RuntimeError, match=match), Tracker().timer("t/g", device="cuda"):
        pass


def test_a_clock_that_goes_back_and_a_changed_group_size_raise() -> None:
    t = Tracker()
    match = r"'t/b': seconds must be finite and >= 0, got -1\.0"
    with pytest.raises(ValueError, match=match), t.timer("t/b", clock=iter([2.0, 1.0]).__next__):
        pass
    t.elapsed("t/c", 1.0, rank=0, world_size=2)
    with pytest.raises(ValueError, match="'t/c' is already logged as kind 'rank_time@2'"):
        t.elapsed("t/c", 1.0, rank=0, world_size=4)


def test_the_docs_example_runs() -> None:
    text = (Path(__file__).parents[2] / "docs" / "timing.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", text, re.S)
    exec(compile(example, "docs/timing.md", "exec"), {})
