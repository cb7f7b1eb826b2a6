"""Windows: several steps merged and reported once equal one step over all their data.

The reference is numpy on the window's concatenated data (``helpers.reference``), or,
for the quantile sketch, one tracker that logged all of it in one step. Hypothesis draws
how the data splits into steps and calls, where a run is checkpointed and resumed, and
whether the window closes by itself or is flushed.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlmetrics import RejectedInputError, Tracker, TrackerState, Window

from gloo_ranks import count_collectives, ok_results, run_together
from helpers import assert_results, log_piece, reference, scale_of, split, value_reps

PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KINDS = ("mean", "sum", "max", "min", "std", "last", "dist", "quantile")
WEIGHTED = {"mean", "std", "sum"}  # real weights; the other kinds select weight > 0

grid = st.integers(-64, 64).map(lambda k: k / 4)
floats = st.floats(-1e3, 1e3, allow_nan=False, allow_subnormal=False)


@dataclass
class Plan:
    """One metric's window data and how it is logged: ``steps[i]`` is the slice of the
    data logged in step i (empty: not logged in that step), cut into calls."""

    kind: str
    x: np.ndarray
    w: np.ndarray | None
    steps: list[list[slice]]


@st.composite
def plans(draw: st.DrawFn, num_steps: int) -> dict[str, Plan]:
    """Every kind's data, split over ``num_steps`` steps and, within a step, into calls."""
    out = {}
    for kind in KINDS:
        n = draw(st.integers(0, 12))
        x = np.array(draw(st.lists(draw(st.sampled_from([grid, floats])), min_size=n, max_size=n)))
        if kind in WEIGHTED:
            weight = st.one_of(st.just(0.0), st.floats(1e-3, 10.0), st.integers(1, 4).map(float))
        else:
            weight = st.sampled_from([0.0, 1.0, 1.0])
        w = (
            np.array(draw(st.lists(weight, min_size=n, max_size=n)))
            if draw(st.booleans())
            else None
        )
        cuts = draw(st.lists(st.integers(0, n), min_size=num_steps - 1, max_size=num_steps - 1))
        steps = []
        for piece in split(n, cuts):
            size = piece.stop - piece.start
            inner = draw(st.lists(st.integers(0, size), max_size=3))
            calls = [slice(piece.start + s.start, piece.start + s.stop) for s in split(size, inner)]
            steps.append([c for c in calls if c.stop > c.start])
        out[f"m/{kind}"] = Plan(kind, x, w, steps)
    return out


def log_step(tracker: Tracker, metrics: dict[str, Plan], step: int, rnd: random.Random) -> None:
    """Log every metric's calls of ``step`` (python numbers, arrays or tensors)."""
    for name, plan in metrics.items():
        for call in plan.steps[step]:
            x = plan.x[call]
            w = None if plan.w is None else plan.w[call]
            if plan.kind == "last":
                reps = [r for r in ("py", "py0d") if r in value_reps(x)]
            else:
                reps = value_reps(x)
            kind = plan.kind

            def log(value: object, weight: object = None, name: str = name, kind: str = kind):
                tracker.log(name, value, weight, kind=kind)

            log_piece(log, x, w, rnd.choice(reps), rnd)


def expected(metrics: dict[str, Plan]) -> dict[str, float]:
    """The window's values: numpy on all its data, the sketch as one tracker's step."""
    out: dict[str, float] = {}
    one_step = Tracker()
    for name, plan in metrics.items():
        if plan.kind == "quantile":
            if plan.x.size:
                one_step.quantile(name, plan.x, weight=plan.w)
        else:
            out.update(reference(plan.kind, name, plan.x, plan.w))
    return {**out, **one_step.compute()}


def check_window(actual: dict[str, float], metrics: dict[str, Plan]) -> None:
    want = expected(metrics)
    assert sorted(actual) == sorted(want), (actual, want)
    for name, plan in metrics.items():
        keys = [k for k in want if k == name or k.startswith(name + "/")]
        scale = scale_of(plan.kind, plan.x, plan.w)
        kind = "dist" if plan.kind == "quantile" else plan.kind
        assert_results({k: actual[k] for k in keys}, {k: want[k] for k in keys}, kind, scale)


@pytest.mark.usefixtures("log_path")  # host and tensor paths
@PROPERTY
@given(data=st.data(), num_steps=st.integers(1, 4))
def test_window_equals_one_step_over_its_data(data: st.DataObject, num_steps: int) -> None:
    """Every kind; the data split into steps and calls at random; the window closes by
    itself or is flushed; a checkpoint taken after any step and resumed into a new
    tracker and window; per-step values equal each step's own compute()."""
    metrics = data.draw(plans(num_steps))
    rnd = random.Random(data.draw(st.integers(0, 2**16)))
    closes = data.draw(st.booleans())
    resume_after = data.draw(st.integers(-1, num_steps - 1))
    tracker, per_step_tracker = Tracker(), Tracker()
    window = Window(tracker, every=num_steps if closes else None, per_step=True)
    want_steps, out = [], None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a `last` merged as disagreeing ranks would warn
        for step in range(num_steps):
            log_step(tracker, metrics, step, rnd)
            log_step(per_step_tracker, metrics, step, random.Random(step))
            want_steps.append(per_step_tracker.compute())
            out = window.step()
            assert (out is not None) == (closes and step == num_steps - 1)
            per_step = window.per_step_values
            if step == resume_after:
                saved = json.loads(json.dumps(window.state_dict()))
                tracker = Tracker()
                window = Window(tracker, every=window.every, per_step=True)
                window.load_state_dict(saved)
        if not closes:
            assert len(window) == num_steps
            out = window.flush()
            per_step = window.per_step_values
    check_window(out, metrics)
    assert window.num_steps == num_steps
    assert len(per_step) == num_steps
    for got, want in zip(per_step, want_steps, strict=True):
        assert got == pytest.approx(want, rel=1e-12, abs=0, nan_ok=True)
    assert len(window) == 0 and window.flush() == {}  # a new, empty window


def test_last_is_the_latest_step_that_logged_it() -> None:
    """A later step's `last` replaces an earlier one's (a merge of the two states, as
    of two ranks, would report their mean and warn); a step that logs it with weight 0
    only keeps the earlier value; max is the window's."""
    tracker = Tracker()
    window = Window(tracker, every=3)
    steps = [
        ({"lr": (1.0, 1.0), "x": 5.0}),
        ({"lr": (2.0, 1.0), "x": 9.0}),
        ({"lr": (3.0, 0.0), "x": 7.0}),
    ]
    states = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for logs in steps:
            value, weight = logs["lr"]
            tracker.last("lr", value, weight=weight)
            tracker.max("x", logs["x"])
            states.append(tracker.state())
            out = window.step()
    assert out == {"lr": 2.0, "x": 9.0}
    with warnings.catch_warnings():  # it warns ("values disagree")
        warnings.simplefilter("ignore")
        # why the window keeps time order: merged as ranks, two steps' values disagree
        assert TrackerState.merge_all(states).compute()["lr"] == 1.5


def test_flush_reports_a_partial_window_and_keeps_unstepped_calls() -> None:
    tracker = Tracker()
    window = Window(tracker, every=10)
    tracker.sum("n", 2.0)
    window.step()
    tracker.sum("n", 3.0)
    window.step()
    tracker.sum("n", 100.0)  # not stepped: the next window's
    assert window.flush() == {"n": 5.0}
    window.step()
    assert window.flush() == {"n": 100.0}
    assert window.flush() == {}


def test_state_flush_without_reset_and_reset() -> None:
    """state(): the open window merged in time order, local; flush(reset=False) keeps
    the window open; reset() drops it without a report."""
    tracker = Tracker()
    window = Window(tracker, every=None)
    for lr, n in ((1.0, 2.0), (2.0, 3.0)):
        tracker.last("lr", lr)
        tracker.sum("n", n)
        window.step()
    assert window.state().compute() == {"lr": 2.0, "n": 5.0}
    assert window.flush(reset=False) == {"lr": 2.0, "n": 5.0}
    tracker.sum("n", 1.0)
    window.step()
    assert window.flush(reset=False) == {"lr": 2.0, "n": 6.0} and len(window) == 3
    window.reset()
    assert len(window) == 0 and window.flush() == {} and window.state().metrics == {}


def test_resume_into_a_window_that_wants_other_per_step_values() -> None:
    """A window saved without per-step values and resumed with them reports none for
    the saved steps (and the other way round, none at all)."""
    tracker = Tracker()
    plain, stepwise = Window(tracker, every=2), Window(tracker, every=2, per_step=True)
    tracker.sum("n", 1.0)
    plain.step()
    stepwise.load_state_dict(plain.state_dict())
    tracker.sum("n", 2.0)
    assert stepwise.step() == {"n": 3.0}
    assert stepwise.per_step_values == [{}, {"n": 2.0}]
    tracker.sum("n", 1.0)
    stepwise.step()
    plain.load_state_dict(stepwise.state_dict())
    tracker.sum("n", 2.0)
    assert plain.step() == {"n": 3.0} and plain.per_step_values == []


def test_per_step_values_only_for_selected_names() -> None:
    tracker = Tracker()
    window = Window(tracker, every=2, per_step=["a", "grp/"])
    for step in range(2):
        tracker.mean("a", float(step))
        tracker.mean("b", 10.0 + step)
        tracker.dist("grp/d", [step, step + 2])
        window.step()
    assert window.per_step_values[0]["a"] == 0.0 and window.per_step_values[1]["a"] == 1.0
    assert window.per_step_values[1]["grp/d/max"] == 3.0
    assert all("b" not in values for values in window.per_step_values)


def test_rejected_call_is_reported_at_the_window_and_the_rest_flushes() -> None:
    tracker = Tracker()
    window = Window(tracker, every=2)
    tracker.mean("m", torch.tensor([1.0, 3.0]))
    tracker.mean("bad", torch.tensor([1.0]), weight=torch.tensor([-1.0]))  # rejected
    assert window.step() is None  # reported at the window's sync, on every rank
    tracker.mean("m", 5.0)
    with pytest.raises(RejectedInputError, match="'bad'"):
        window.step()
    assert window.flush() == {"m": 3.0}


def log_changed_in_place(tracker: Tracker, how: str) -> None:
    """A call of ``tracker``'s step that its fold drops, ``how``: a tensor changed in
    place after the call (found at the step's end, or by an early fold inside a later
    call), the same with ``by=``, or a ``by=`` label missing from ``labels=``. The
    tracker records CPU tensors by reference, as device tensors are (a CPU tensor is
    copied at the call: no change after it reaches the record)."""
    tracker.copy_cpu_tensors = False
    if how == "early":
        tracker.record_limit = 3  # x's call stays below it, n's passes it: n's call folds
    x = torch.tensor([1.0, 2.0])
    if how == "by_label":
        tracker.mean("x", x, by=torch.tensor([0, 5]), labels={0: "a"})
    elif how == "by":
        tracker.mean("x", x, by=torch.tensor([0, 0]), labels={0: "a"})
    else:
        tracker.mean("x", x)
    if how != "by_label":
        x.add_(10)
    tracker.sum("n", 1.0)


@pytest.mark.parametrize("how", ["in_place", "early", "by", "by_label"])
def test_a_call_dropped_at_the_fold_counts_the_step_and_raises_at_the_report(how: str) -> None:
    """A step whose fold drops a call (``ModifiedInputError``, a ``by=`` call) is counted
    like any other: ``step()`` does not raise (on one rank of a sync, raising there
    closed that rank's windows a step later than its peers'), the report raises naming
    the metric, as for a rejected call, and ``flush()`` reports the rest."""
    tracker = Tracker()
    window = Window(tracker, every=2)
    log_changed_in_place(tracker, how)
    assert window.step() is None
    assert (window.num_steps, len(window)) == (1, 1)
    tracker.record_limit = Tracker.record_limit
    tracker.mean("x", torch.tensor([4.0]))
    tracker.sum("n", 1.0)
    name = "'x'" if how != "by_label" else "metric 'x': label 5 is not in labels="
    with pytest.raises(RejectedInputError, match=f"1 step\\(s\\) .*{name}"):
        window.step()
    assert (window.num_steps, len(window)) == (2, 2)
    assert window.flush() == {"n": 2.0, "x": 4.0}
    assert tracker.compute() == {}


def test_dropped_and_rejected_calls_of_one_step_are_both_named() -> None:
    tracker = Tracker()
    window = Window(tracker, every=1)
    log_changed_in_place(tracker, "in_place")
    tracker.mean("bad", torch.tensor([1.0]), weight=torch.tensor([-1.0]))  # rejected
    with pytest.raises(RejectedInputError, match=r"changed in place.*'x'.* Then: .*'bad'"):
        window.step()
    assert window.num_steps == 1 and window.flush() == {"n": 1.0}


@pytest.mark.parametrize("empty", ["omit", "nan"])
@pytest.mark.parametrize("per_step", [False, True])
def test_keys_two_metrics_report_raise_as_in_compute(empty: str, per_step: bool) -> None:
    """A `last` named `x/p50` beside a dist `x` (each in a step of its own, or both in
    one): one step over the window's data raises naming both, so the report does (it
    reported the `last`'s value as `x/p50` and dropped the dist's p50)."""
    one_step = Tracker(empty=empty)
    one_step.dist("x", [1.0, 2.0, 3.0])
    one_step.last("x/p50", 7.0)
    with pytest.raises(ValueError, match="rename one of them") as expected:
        one_step.compute()
    for split_steps in (True, False):
        tracker = Tracker(empty=empty)
        window = Window(tracker, every=2, per_step=per_step)
        tracker.dist("x", [1.0, 2.0, 3.0])
        if split_steps:
            window.step()
        tracker.last("x/p50", 7.0)
        if not split_steps:
            window.step()
        with pytest.raises(ValueError) as raised:
            window.step()
        assert str(raised.value) == str(expected.value)


def test_a_name_changing_kind_inside_a_window_is_dropped_and_raises_at_the_report() -> None:
    """A metric logged as another kind than earlier in the window takes the path of a
    rejected call: ``step()`` counts the step without it (raising there made one rank of
    a sync close its windows a step after its peers', and left the call in the tracker
    for the next step), the report raises naming it and both kinds, and ``flush()``
    reports the rest; the next window may use the new kind."""
    tracker = Tracker()
    window = Window(tracker, every=2)
    tracker.mean("x", 1.0)
    tracker.mean("y", 2.0)
    assert window.step() is None
    tracker.max("x", 4.0)
    tracker.mean("y", 5.0)
    message = r"1 step\(s\).*metric 'x' is kind 'max' in the window's step 1 but 'mean'"
    with pytest.raises(RejectedInputError, match=message):
        window.step()
    assert (window.num_steps, len(window), tracker.compute()) == (2, 2, {})
    assert window.flush() == {"x": 1.0, "y": 3.5}
    tracker.max("x", 4.0)
    assert window.step() is None
    tracker.max("x", 3.0)
    assert window.step() == {"x": 4.0}


def test_nonfinite_counts_add_over_the_window_for_every_kind() -> None:
    """Under nonfinite="skip", a replacing kind's count covers every step of the window,
    not only the one whose value it reports."""
    window_tracker, one_step = Tracker(nonfinite="skip"), Tracker(nonfinite="skip")
    window = Window(window_tracker, every=2)
    steps = [([math.nan, 1.0], [1.0, math.inf]), ([2.0, math.inf], [3.0])]
    for lrs, values in steps:
        for tracker in (window_tracker, one_step):
            for lr in lrs:
                tracker.last("lr", lr)
            tracker.mean("m", values)
        out = window.step()
    assert out == one_step.compute()
    assert out["lr/nonfinite_count"] == 2.0 and out["lr"] == 2.0


def test_empty_nan_reports_nan_for_a_last_never_given_a_value() -> None:
    tracker = Tracker(empty="nan")
    window = Window(tracker, every=2)
    tracker.last("lr", 1.0, weight=0.0)
    window.step()
    tracker.last("lr", 2.0, weight=0.0)
    assert math.isnan(window.step()["lr"])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"every": 0}, ValueError, r"every=\.\.\.\) must be an int >= 1 or None, got 0"),
        ({"every": True}, ValueError, "got True"),
        ({"every": 2, "per_step": "a"}, TypeError, "wrap it in a list"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Window(Tracker(), **kwargs)


def test_bad_tracker_and_state_dict() -> None:
    with pytest.raises(TypeError, match=r"pass the view's \.tracker"):
        Window(Tracker().prefixed("a/"), every=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"expected a Window\.state_dict"):
        Window(Tracker(), every=1).load_state_dict({"version": 99})


DOC = Path(__file__).resolve().parents[2] / "docs" / "windows.md"


@pytest.mark.parametrize("index", [0, 1])
def test_doc_examples_print_what_the_doc_says(index: int) -> None:
    """docs/windows.md's examples run and print the output shown after them."""
    pairs = re.findall(r"```python\n(.*?)```\n\nprints\n\n```\n(.*?)```", DOC.read_text(), re.S)
    code, printed = pairs[index]
    torch.manual_seed(0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(DOC), "exec"), {})
    assert out.getvalue() == printed


def test_docstring_example() -> None:
    import doctest

    import rlmetrics.window

    assert doctest.testmod(rlmetrics.window).failed == 0


# -- real gloo ranks ---------------------------------------------------------------------
NUM_WINDOWS, STEPS_PER_WINDOW = 3, 3
GLOO_KINDS = ("mean", "sum", "max", "min", "std", "dist", "quantile")
SCALAR_KINDS = ("mean", "sum", "max", "min", "quantile")  # no extra to gather
# collectives of a steady-state report: what one step's compute() of the same metrics
# issues (one packed gather, and one more for std's and dist's extras)
STEADY = {GLOO_KINDS: 2, SCALAR_KINDS: 1}


def gloo_data(
    seed: int, world: int, kinds: tuple[str, ...]
) -> list[list[dict[str, tuple[str, np.ndarray, list]]]]:
    """[window][step] -> {name: (kind, values, one slice per rank)}; every rank builds
    the same from ``seed``. Some ranks' slices are empty (a rank with no data)."""
    rng = np.random.default_rng(seed)
    windows = []
    for _ in range(NUM_WINDOWS):
        steps = []
        for _ in range(STEPS_PER_WINDOW):
            step = {}
            for kind in kinds:
                n = int(rng.integers(1, 9))  # some rank logs it: the names stay the same
                x = np.round(rng.normal(3.0, 5.0, n), 2)
                cuts = sorted(int(c) for c in rng.integers(0, n + 1, world - 1))
                step[f"m/{kind}"] = (kind, x, split(n, cuts))
            steps.append(step)
        windows.append(steps)
    return windows


def gloo_windows(
    rank: int, world: int, seed: int, kinds: tuple[str, ...]
) -> list[tuple[object, list, int]]:
    """Log this rank's share of every step; per step: (step() result, per-step values,
    collectives issued by step())."""
    import torch.distributed as tdist

    group = tdist.new_group(list(range(world)))  # nothing agreed yet over it
    tracker = Tracker()
    window = Window(tracker, every=STEPS_PER_WINDOW, group=group, timeout=60, per_step=True)
    out = []
    with pytest.MonkeyPatch.context() as patch:
        counts = count_collectives(patch)
        for w, steps in enumerate(gloo_data(seed, world, kinds)):
            for s, step in enumerate(steps):
                for name, (kind, x, pieces) in step.items():
                    if pieces[rank].stop > pieces[rank].start:
                        tracker.log(name, torch.from_numpy(x[pieces[rank]]), kind=kind)
                tracker.last("lr", 0.1 * (3 * w + s))  # every rank, every step
                # "late": the last rank logs it in the window's last step, the others in
                # its first: the window's value is the last rank's
                if (rank == world - 1) == (s == STEPS_PER_WINDOW - 1):
                    tracker.last("late", 100.0 * w + s)
                before = counts["n"]
                result = window.step()
                out.append((result, window.per_step_values, counts["n"] - before))
    return out


def gloo_rejected(rank: int, world: int) -> dict[str, object]:
    """Rank 1 logs a rejected call in a window's first step: every rank raises at the
    report, and flush() then reports the rest."""
    tracker = Tracker()
    window = Window(tracker, every=2, timeout=60)
    tracker.mean("m", float(rank))
    if rank == 1:
        tracker.mean("bad", torch.tensor([1.0]), weight=torch.tensor([-1.0]))
    out: dict[str, object] = {"first": window.step()}
    tracker.mean("m", float(rank + 10))
    try:
        window.step()
    except RejectedInputError as error:
        out["error"] = str(error)
    out["flush"] = window.flush()
    return out


def gloo_collision(rank: int, world: int) -> list[str]:
    """Rank 0 logs a dist `x`, the last rank a `last` named `x/p50`: compute() over the
    group raises on every rank, naming both; so does a window's report."""
    messages = []
    tracker = Tracker()
    window = Window(tracker, every=1, timeout=60)
    for report in (lambda: tracker.compute(timeout=60), window.step):
        if rank == 0:
            tracker.dist("x", [1.0, 2.0, 3.0])
        if rank == world - 1:
            tracker.last("x/p50", 7.0)
        try:
            report()
        except ValueError as error:
            messages.append(str(error))
        tracker.reset()
    return messages


LRS = ((0.1, True), (0.2, True), (0.3, False), (0.1, True))  # (lr, ranks disagree)


def gloo_disagree(rank: int, world: int) -> tuple[list, list[str]]:
    """Each step a report: the ranks' `actor/lr` disagree in steps 0 and 1, agree in 2,
    disagree again in 3. Returns the reports and this rank's RuntimeWarnings."""
    tracker = Tracker()
    actor = tracker.prefixed("actor/")
    window = Window(tracker, every=1, timeout=60, per_step=["actor/"])
    reports = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for lr, disagree in LRS:
            actor.last("lr", lr * (rank + 1) if disagree else lr)
            reports.append((window.step(), window.per_step_values))
    return reports, [str(w.message) for w in caught if w.category is RuntimeWarning]


def step_or_flush(window: Window) -> list[object]:
    """``[window.step()'s report]``, or, when it raises, ``[(type, message), the
    flush() after it]`` (the recovery docs/windows.md gives)."""
    try:
        return [window.step()]
    except ValueError as error:
        return [(type(error).__name__, str(error)), window.flush()]


def gloo_modified(rank: int, world: int) -> list[object]:
    """Rank 0 changes a logged tensor in place in the first step of windows of two
    steps: per step, the step()'s report, error (type, message) or the flush() after
    it, then the window's step count. Tensors are kept by reference, as device tensors
    are."""
    tracker = Tracker()
    tracker.copy_cpu_tensors = False
    window = Window(tracker, every=2, timeout=20)
    out: list[object] = []
    for step in range(6):
        x = torch.tensor([float(rank + 1)])
        tracker.mean("x", x)
        tracker.sum("n", 1.0)
        if rank == 0 and step == 0:
            x.add_(10)
        out.extend(step_or_flush(window))
    return [*out, window.num_steps]


def gloo_kind_change(rank: int, world: int) -> list[object]:
    """Rank 1 logs "x" as a max in the second step of the first window of two steps
    (every other step and rank log it as a mean): per step, the step()'s report, or its
    error (type, message) and the flush() after it, then the window's step count."""
    tracker = Tracker()
    window = Window(tracker, every=2, timeout=20)
    out: list[object] = []
    for step in range(6):
        if rank == 1 and step == 1:
            tracker.max("x", 7.0)
        else:
            tracker.mean("x", float(rank + step))
        tracker.mean("y", float(rank + 10 * step))
        out.extend(step_or_flush(window))
    return [*out, window.num_steps]


ASYNC_LENGTHS = (2, 3, 1, 4, 2)  # iterations per logged step


def gloo_async(rank: int, world: int) -> list[tuple[dict, int]]:
    """Windows closed by flush() after a varying number of iterations (every=None):
    per window, (report, collectives of the flush)."""
    import torch.distributed as tdist

    group = tdist.new_group(list(range(world)))
    tracker = Tracker()
    window = Window(tracker, every=None, group=group, timeout=60)
    out = []
    with pytest.MonkeyPatch.context() as patch:
        counts = count_collectives(patch)
        for w, length in enumerate(ASYNC_LENGTHS):
            for it in range(length):
                tracker.sum("count/samples", rank + 1)
                tracker.mean("actor/pg_loss", [float(rank), float(it)])
                tracker.last("training/global_step", 10 * w + it)
                assert window.step() is None
            before = counts["n"]
            out.append((window.flush(), counts["n"] - before))
    return out


def window_expected(steps: list[dict], w: int, last: int) -> dict[str, float]:
    """The values of ``steps`` of window ``w`` (``last``: the last one's index in the
    window) by numpy (the sketch: one tracker's step over their data)."""
    want: dict[str, float] = {"lr": 0.1 * (3 * w + last), "late": 100.0 * w + last}
    sketch = Tracker()
    for name in steps[0]:
        kind = steps[0][name][0]
        x = np.concatenate([step[name][1] for step in steps])
        if kind == "quantile":
            if x.size:
                sketch.quantile(name, x)
        else:
            want.update(reference(kind, name, x, None))
    return {**want, **sketch.compute()}


def assert_numpy(got: dict[str, float], want: dict[str, float], kinds: tuple[str, ...]) -> None:
    assert sorted(got) == sorted(want)
    for kind in (*kinds, "last"):
        keys = ["lr", "late"] if kind == "last" else [k for k in want if f"m/{kind}" in k]
        assert_results({k: got[k] for k in keys}, {k: want[k] for k in keys}, kind, 10.0)


@pytest.fixture(scope="module", params=[2, 4], ids=["2_ranks", "4_ranks"])
def gloo_outcome(request: pytest.FixtureRequest) -> tuple[int, dict]:
    world = request.param
    calls = {
        "windows": (gloo_windows, (world, GLOO_KINDS)),
        "scalar_windows": (gloo_windows, (world + 1, SCALAR_KINDS)),
        "rejected": (gloo_rejected, ()),
        "async": (gloo_async, ()),
        "collision": (gloo_collision, ()),
        "disagree": (gloo_disagree, ()),
        "modified": (gloo_modified, ()),
        # last: before their fixes, these left the ranks out of step
        "kind_change": (gloo_kind_change, ()),
    }
    return world, run_together(calls, world, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("kinds", [GLOO_KINDS, SCALAR_KINDS], ids=["all_kinds", "scalar_kinds"])
def test_gloo_window_equals_numpy_with_one_sync_per_report(
    gloo_outcome: tuple, kinds: tuple[str, ...]
) -> None:
    """Every rank reports the window over all ranks' data of all its steps; steps that
    do not close a window issue no collective; a steady-state report issues what one
    step's compute() would (one collective for scalar kinds)."""
    world, outcome = gloo_outcome
    seed = world if kinds == GLOO_KINDS else world + 1
    per_rank = ok_results(outcome["windows" if kinds == GLOO_KINDS else "scalar_windows"])
    data = gloo_data(seed, world, kinds)
    for i in range(NUM_WINDOWS * STEPS_PER_WINDOW):
        w, s = divmod(i, STEPS_PER_WINDOW)
        results = [rank_out[i] for rank_out in per_rank]
        counts = {count for _, _, count in results}
        if s < STEPS_PER_WINDOW - 1:
            assert all(result is None for result, _, _ in results) and counts == {0}
            continue
        got, per_step = results[0][0], results[0][1]
        assert all((result, steps) == (got, per_step) for result, steps, _ in results)
        assert_numpy(got, window_expected(data[w], w, s), kinds)
        assert len(per_step) == STEPS_PER_WINDOW
        for j, values in enumerate(per_step):  # synced in the same collective
            assert_numpy(values, window_expected([data[w][j]], w, j), kinds)
        if w > 0:  # the first report agrees on the schema first
            assert counts == {STEADY[kinds]}, (w, counts)


@pytest.mark.slow
def test_gloo_rejected_call_raises_on_every_rank_at_the_report(gloo_outcome: tuple) -> None:
    world, outcome = gloo_outcome
    per_rank = ok_results(outcome["rejected"])
    mean = (sum(range(world)) + sum(range(10, 10 + world))) / (2 * world)
    for rank, out in enumerate(per_rank):
        assert out["first"] is None
        assert "1 step(s) of the window had rejected or dropped calls" in out["error"]
        assert ("'bad'" in out["error"]) == (rank == 1), out["error"]
        assert out["flush"] == {"m": mean}


@pytest.mark.slow
def test_gloo_windows_of_varying_length_stay_one_sync(gloo_outcome: tuple) -> None:
    """An asynchronous trainer's logged steps of 1 to 4 iterations each: every report
    after the first is one collective, with the window's sums, means and last value."""
    world, outcome = gloo_outcome
    per_rank = ok_results(outcome["async"])
    for w, length in enumerate(ASYNC_LENGTHS):
        loss = np.mean([[r, it] for r in range(world) for it in range(length)])
        want = {
            "actor/pg_loss": pytest.approx(loss, rel=1e-12),
            "count/samples": length * world * (world + 1) / 2,
            "training/global_step": 10 * w + length - 1,
        }
        for report, count in (rank_out[w] for rank_out in per_rank):
            assert report == want
            assert w == 0 or count == 1, (w, count)


@pytest.mark.slow
def test_gloo_keys_two_metrics_report_raise_on_every_rank_as_in_compute(
    gloo_outcome: tuple,
) -> None:
    for messages in ok_results(gloo_outcome[1]["collision"]):
        assert len(messages) == 2 and messages[0] == messages[1], messages
        assert "'x/p50' reports 'x/p50', which metric 'x' reports too" in messages[0]


@pytest.mark.slow
def test_gloo_last_disagreement_names_the_metric_and_warns_again(gloo_outcome: tuple) -> None:
    """The report's warning names the user's metric (not the window's internal key);
    a disagreement lasting two steps warns once, a later one again."""
    world, outcome = gloo_outcome
    for reports, messages in ok_results(outcome["disagree"]):
        for (report, per_step), (lr, disagree) in zip(reports, LRS, strict=True):
            want = np.mean([lr * (r + 1) for r in range(world)]) if disagree else lr
            assert report == per_step[0] == {"actor/lr": pytest.approx(want, rel=1e-15)}
        assert len(messages) == 2, messages
        for number, message in enumerate(messages, 1):
            assert message.startswith("metric 'actor/lr' (kind 'last'): merged values disagree")
            assert f"Disagreement {number} of this metric" in message


@pytest.mark.slow
def test_gloo_tensor_changed_in_place_on_one_rank_keeps_the_windows_paired(
    gloo_outcome: tuple,
) -> None:
    """Rank 0's step() counts the step with its changed tensor's call dropped, as every
    rank counts it: the first window's report raises on every rank (rank 0 naming the
    metric), flush() reports the rest, and the later windows pair the same steps."""
    world, outcome = gloo_outcome
    ranks = range(1, world + 1)  # rank r logs x = r + 1
    rest = (2 * sum(ranks) - 1) / (2 * world - 1)  # both steps but rank 0's first x
    for rank, out in enumerate(ok_results(outcome["modified"])):
        assert out[0] is None
        error_type, message = out[1]  # type: ignore[misc]
        assert error_type == "RejectedInputError", message
        assert ("changed in place" in message and "'x'" in message) == (rank == 0), message
        assert out[2] == {"n": 2.0 * world, "x": pytest.approx(rest, rel=1e-15)}
        paired = {"n": 2.0 * world, "x": pytest.approx(np.mean(ranks), rel=1e-15)}
        assert out[3:] == [None, paired, None, paired, 6], out


@pytest.mark.slow
def test_gloo_kind_change_on_one_rank_keeps_the_windows_paired(gloo_outcome: tuple) -> None:
    """Rank 1 logs a window's metric as another kind in one step: its step() counts the
    step without that metric, as every rank counts it, so the report raises on every
    rank (rank 1 naming the metric and both kinds), flush() reports the rest (numpy's
    means over every other call), and the later windows pair the same steps (rank 1
    raised in step(), its flush() paired with its peers' report, and the windows then
    held other steps: x = 7.0 from the max, y = 3.33 where the truth is 3.5)."""
    world, outcome = gloo_outcome
    ranks = range(world)

    def means(steps: range, skip: tuple[int, int] | None = None) -> dict[str, object]:
        x = [r + s for s in steps for r in ranks if (r, s) != skip]
        y = [r + 10 * s for s in steps for r in ranks]
        return {
            "x": pytest.approx(np.mean(x), rel=1e-15),
            "y": pytest.approx(np.mean(y), rel=1e-15),
        }

    for rank, out in enumerate(ok_results(outcome["kind_change"])):
        assert out[0] is None
        error_type, message = out[1]  # type: ignore[misc]
        assert error_type == "RejectedInputError", message
        named = "metric 'x' is kind 'max' in the window's step 1 but 'mean'"
        assert (named in message) == (rank == 1), message
        assert out[2] == means(range(2), skip=(1, 1))
        assert out[3:] == [None, means(range(2, 4)), None, means(range(4, 6)), 6], out
