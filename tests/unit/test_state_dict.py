"""state_dict / load_state_dict of a Tracker and a Window: a damaged or foreign dict
raises ``MalformedStateError`` naming where, and changes nothing; a user kind's extra
of every documented type comes back equal."""

from __future__ import annotations

import json
import math
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlmetrics import (
    ExtraKind,
    MalformedStateError,
    MetricState,
    Tracker,
    TrackerState,
    Window,
    register_kind,
    unregister_kind,
)
from rlmetrics.kinds import Batch
from rlmetrics.kinds.histogram import Histogram

HIST = Histogram(name="test_sd_hist", edges=(0.0, 1.0, 2.0), quantiles=(0.5,))


@pytest.fixture(scope="module", autouse=True)
def kinds() -> Any:
    register_kind(HIST, exist_ok=True)
    for fmt in FORMATS:
        register_kind(KEPT[fmt], exist_ok=True)
    yield
    unregister_kind(HIST.name)
    for fmt in FORMATS:
        unregister_kind(KEPT[fmt].name)


def fill(t: Tracker) -> Tracker:
    """Log into ``t`` every built-in kind, a sketch and a histogram."""
    values = torch.tensor([0.5, 1.5, 3.0, -1.0], dtype=torch.float64)
    t.mean("a/mean", values, weight=torch.tensor([1.0, 2.0, 0.0, 1.0], dtype=torch.float64))
    t.sum("a/sum", [1.0, 2.0])
    t.max("a/max", values)
    t.min("a/min", values)
    t.std("a/std", values)
    t.last("a/last", 0.25)
    t.dist("a/dist", values)
    t.log("a/sketch", values, kind="quantile")
    t.log("a/hist", values, kind=HIST.name)
    return t


def filled() -> Tracker:
    return fill(Tracker())


# -- a damaged or foreign dict: one error, naming where; nothing changes -----------------
def _metric(sd: dict, name: str) -> dict:
    return sd["metrics"][name]


def _set(path: tuple, value: Any) -> Callable[[dict], None]:
    def damage(sd: dict) -> None:
        node = sd
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return damage


def _delete(*path: Any) -> Callable[[dict], None]:
    def damage(sd: dict) -> None:
        node = sd
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return damage


def _truncate(*path: Any) -> Callable[[dict], None]:
    def damage(sd: dict) -> None:
        node = sd
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = node[path[-1]][:-1]

    return damage


def _replace_all(value: Callable[[], dict]) -> Callable[[dict], None]:
    def damage(sd: dict) -> None:
        sd.clear()
        sd.update(value())

    return damage


M = "metrics"
# label -> (damage, what the message must name)
TRACKER_DAMAGE: dict[str, tuple[Callable[[dict], None], str]] = {
    # missing keys
    "no version": (_delete("version"), "['version']"),
    "no metrics": (_delete(M), "['metrics']"),
    "no kind": (_delete(M, "a/mean", "kind"), "['a/mean']"),
    "no sums": (_delete(M, "a/sum", "sums"), "['a/sum']"),
    "no maxes": (_delete(M, "a/max", "maxes"), "['a/max']"),
    # wrong types
    "metrics a list": (_set((M,), [["a/mean", 1.0]]), "['metrics']"),
    "metric a number": (_set((M, "a/mean"), 1.0), "['a/mean']"),
    "sums a string": (_set((M, "a/sum", "sums"), "3.0"), "['a/sum']['sums']"),
    "sums of strings": (_set((M, "a/mean", "sums"), ["1.0", "2.0"]), "['a/mean']['sums']"),
    "sums of None": (_set((M, "a/mean", "sums"), [None, 1.0]), "['a/mean']['sums']"),
    "sums of bools": (_set((M, "a/mean", "sums"), [True, 1.0]), "['a/mean']['sums']"),
    "maxes a dict": (_set((M, "a/max", "maxes"), {"x": 1.0}), "['a/max']['maxes']"),
    "kind a number": (_set((M, "a/mean", "kind"), 3), "['a/mean']['kind']"),
    "nonfinite a string": (_set((M, "a/mean", "num_nonfinite"), "x"), "['num_nonfinite']"),
    "nonfinite negative": (_set((M, "a/mean", "num_nonfinite"), -1.0), "['num_nonfinite']"),
    "fingerprint a number": (_set((M, "a/mean", "fingerprint"), 5), "['fingerprint']"),
    "std extra a string": (_set((M, "a/std", "extra"), "abc"), "['a/std']"),
    "std extra of strings": (_set((M, "a/std", "extra"), ["a", "b", "c"]), "['a/std']"),
    # the trial result converts numeric strings; the merge does not (issue 41)
    "std extra of numeric strings": (_set((M, "a/std", "extra"), ["3", "2.3", "4.6"]), "['a/std']"),
    "std extra with None": (_set((M, "a/std", "extra"), [3.0, None, 8.0]), "['a/std']"),
    "std weight negative": (_set((M, "a/std", "extra"), [-3.0, 3.0, 8.0]), "['a/std']"),
    "std weight a bool": (_set((M, "a/std", "extra"), [True, 3.0, 8.0]), "['a/std']"),
    "std weight NaN": (_set((M, "a/std", "extra"), [math.nan, 3.0, 8.0]), "['a/std']"),
    "dist extra a string": (_set((M, "a/dist", "extra"), "abc"), "['a/dist']"),
    "dist extra of strings": (_set((M, "a/dist", "extra"), {"array": ["x"]}), "['a/dist']"),
    "dist extra ragged": (_set((M, "a/dist", "extra"), {"array": [[1.0], []]}), "['a/dist']"),
    "dist extra nested": (_set((M, "a/dist", "extra"), {"array": [[1.0], [2.0]]}), "['a/dist']"),
    "dist extra a number": (_set((M, "a/dist", "extra"), 2.0), "['a/dist']"),
    "empty name": (lambda sd: sd[M].update({"": sd[M]["a/mean"]}), "['']"),
    "name a number": (lambda sd: sd[M].update({3: sd[M]["a/mean"]}), "[3]"),
    "version a string": (_set(("version",), "2"), "['version']"),
    "version True": (_set(("version",), True), "['version']"),
    "version 7": (_set(("version",), 7), "unsupported TrackerState version 7"),
    "version 1, never released": (_set(("version",), 1), "unsupported TrackerState version 1"),
    # foreign dicts
    "empty dict": (_replace_all(dict), "['version']"),
    "a window's": (_replace_all(Window(Tracker(), every=1).state_dict), "state_dict"),
    "an optimizer's": (_replace_all(lambda: {"state": {}, "param_groups": []}), "['version']"),
    "unknown top key": (_set(("step",), 3), "'step'"),
    "unknown metric key": (_set((M, "a/mean", "value"), 1.0), "'value'"),
    "metrics of floats": (_set((M,), {"loss": 1.0}), "['loss']"),
    # truncated arrays
    "mean sums": (_truncate(M, "a/mean", "sums"), "['a/mean']"),
    "last maxes": (_truncate(M, "a/last", "maxes"), "['a/last']"),
    "std extra": (_truncate(M, "a/std", "extra"), "['a/std']"),
    "dist values": (lambda sd: _truncate("array")(_metric(sd, "a/dist")["extra"]), "['a/dist']"),
    "histogram bins": (_truncate(M, "a/hist", "sums"), "['a/hist']"),
    "sketch buckets": (_truncate(M, "a/sketch", "sums"), "['a/sketch']"),
    # unknown kind names
    "unknown kind": (_set((M, "a/mean", "kind"), "no_such_kind"), "['a/mean']"),
    "another built-in kind": (_set((M, "a/mean", "kind"), "dist"), "['a/mean']"),
    "a bad family member": (_set((M, "a/mean", "kind"), "rank_time@x"), "['a/mean']"),
    "another histogram": (_set((M, "a/hist", "fingerprint"), "other:4:2:0"), "['a/hist']"),
}


@pytest.mark.parametrize("label", list(TRACKER_DAMAGE))
def test_a_damaged_tracker_state_dict_raises_one_error_and_changes_nothing(label: str) -> None:
    """Missing keys, wrong types, foreign dicts, truncated arrays, unknown kinds: each
    raises ``MalformedStateError`` (a ValueError) naming where, and the tracker keeps
    its metrics (its state_dict() is the same before and after)."""
    damage, where = TRACKER_DAMAGE[label]
    saved = json.loads(json.dumps(filled().state_dict()))
    damage(saved)
    tracker = Tracker()
    tracker.mean("kept", [1.0, 3.0])
    tracker.dist("kept/dist", [1.0, 2.0])
    before = tracker.state_dict()
    with pytest.raises(MalformedStateError, match="malformed") as raised:
        tracker.load_state_dict(saved)
    assert where in str(raised.value), str(raised.value)
    assert isinstance(raised.value, ValueError)
    assert tracker.state_dict() == before
    values = np.array([1.0, 2.0])
    assert tracker.compute() == {
        "kept": 2.0,
        "kept/dist/mean": 1.5,
        "kept/dist/std": values.std(),
        "kept/dist/min": 1.0,
        "kept/dist/max": 2.0,
        **{f"kept/dist/p{q}": np.quantile(values, q / 100) for q in (50, 90, 99)},
    }


def _window_saved() -> tuple[Tracker, Window, dict]:
    """A window of two steps (every kind, per-step values) and its saved dict."""
    tracker = Tracker()
    window = Window(tracker, every=None, per_step=True)
    for _ in range(2):
        fill(tracker)
        window.step()
    return tracker, window, json.loads(json.dumps(window.state_dict()))


WINDOW_DAMAGE: dict[str, tuple[Callable[[dict], None], str]] = {
    "no version": (_delete("version"), "['version']"),
    "version 2": (_set(("version",), 2), "['version']"),
    "no merged": (_delete("merged"), "'merged'"),
    "no latest steps": (_delete("latest_steps"), "'latest_steps'"),
    "unknown key": (_set(("step",), 1), "'step'"),
    "a tracker's": (_replace_all(lambda: filled().state_dict()), "state_dict"),
    "num_steps a string": (_set(("num_steps",), "2"), "['num_steps']"),
    "num_open negative": (_set(("num_open",), -1), "['num_open']"),
    "num_rejected None": (_set(("num_rejected",), None), "['num_rejected']"),
    "message a number": (_set(("rejected_message",), 3), "['rejected_message']"),
    "merged a list": (_set(("merged",), []), "['merged']"),
    "merged sums truncated": (_truncate("merged", M, "a/mean", "sums"), "['merged']"),
    "merged unknown kind": (_set(("merged", M, "a/mean", "kind"), "nope"), "['merged']"),
    "merged dist truncated": (
        lambda sd: _truncate("array")(sd["merged"][M]["a/dist"]["extra"]),
        "['merged']['metrics']['a/dist']",
    ),
    "latest without its step": (_delete("latest_steps", "a/last"), "['latest_steps']"),
    "latest step too late": (_set(("latest_steps", "a/last"), 5), "['latest_steps']['a/last']"),
    "latest step a float": (_set(("latest_steps", "a/last"), 1.0), "['latest_steps']['a/last']"),
    "a last in merged": (
        lambda sd: sd["merged"][M].update({"b": sd["latest"][M]["a/last"]}),
        "['merged']['metrics']['b']",
    ),
    "a mean in latest": (
        lambda sd: (
            sd["latest"][M].update(b=sd["merged"][M]["a/mean"]),
            sd["latest_steps"].update(b=1),
        ),
        "['latest']['metrics']['b']",
    ),
    "per_step a dict": (_set(("per_step",), {}), "['per_step']"),
    "per_step too long": (lambda sd: sd["per_step"].extend(sd["per_step"]), "['per_step']"),
    "per_step damaged": (_set(("per_step", 1, M, "a/std", "extra"), [1.0]), "['per_step'][1]"),
    "merged std of numeric strings": (
        _set(("merged", M, "a/std", "extra"), ["3", "2.3", "4.6"]),
        "['merged']['metrics']['a/std']",
    ),
    "merged std weight negative": (
        _set(("merged", M, "a/std", "extra"), [-3.0, 3.0, 8.0]),
        "['merged']['metrics']['a/std']",
    ),
    "per_step other kind": (
        _set(("per_step", 0, M, "a/mean"), {"kind": "sum", "sums": [1.0], "maxes": []}),
        "['per_step'][0]['metrics']['a/mean']",
    ),
}


@pytest.mark.parametrize("label", list(WINDOW_DAMAGE))
def test_a_damaged_window_state_dict_raises_one_error_and_changes_nothing(label: str) -> None:
    damage, where = WINDOW_DAMAGE[label]
    _, _, saved = _window_saved()
    damage(saved)
    _, window, _ = _window_saved()
    before = window.state_dict()
    with pytest.raises(MalformedStateError, match="malformed") as raised:
        window.load_state_dict(saved)
    assert where in str(raised.value), str(raised.value)
    assert window.state_dict() == before
    assert window.num_steps == 2 and len(window) == 2


BAD_EXTRAS = {  # a metric's name, kind and an extra its merge cannot take or would misreport
    "std numeric strings": ("a/std", "std", ("3", "2.333", "4.667")),
    "std None": ("a/std", "std", (3.0, None, 8.0)),
    "std negative weight": ("a/std", "std", (-3.0, 3.0, 8.0)),
    "std bool weight": ("a/std", "std", (True, 3.0, 8.0)),
    "a user kind's extra of another type": ("z/kept", "test_sd_kept_set", [1.0, 2.0]),
}


@pytest.mark.parametrize("label", list(BAD_EXTRAS))
def test_merging_a_state_whose_extra_cannot_merge_changes_nothing(label: str) -> None:
    """``Tracker.merge(TrackerState)`` checks what each metric's merge will do before
    anything changes: a damaged extra raises ``ValueError`` naming its metric, and the
    tracker keeps its metrics (the metrics before it were merged, then numpy's bare
    ``UFuncTypeError`` or the user kind's ``TypeError`` came); ``TrackerState.merge``
    names the metric too."""
    name, kind, extra = BAD_EXTRAS[label]
    good = filled().state().metrics["a/mean"]
    state = TrackerState(
        {"a/mean": good, name: MetricState(kind, (1.0,) * (kind != "std"), (), extra)}
    )
    tracker = filled()
    tracker.log("z/kept", [5.0], kind="test_sd_kept_set")
    before = tracker.state_dict()
    with pytest.raises(ValueError, match=f"metric '{name}'"):
        tracker.merge(state)
    assert tracker.state_dict() == before
    if label in ("std numeric strings", "std None"):  # a merge that raises
        with pytest.raises(ValueError, match=f"metric '{name}'"):
            tracker.state().merge(state)


def test_load_state_dict_of_a_non_dict_is_a_type_error() -> None:
    for load in (Tracker().load_state_dict, Window(Tracker(), every=1).load_state_dict):
        with pytest.raises(TypeError, match="expected the dict"):
            load([("version", 2)])  # type: ignore[arg-type]


def _paths(node: Any, path: tuple = ()) -> list[tuple]:
    """Every key path into a state_dict's nested dicts and lists."""
    out = [path] if path else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _paths(value, (*path, i))
    return out


JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.lists(st.floats(-5, 5), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_damage_raises_malformed_or_loads_a_state_that_computes(data: Any) -> None:
    """A value anywhere in a state_dict replaced by junk, or a key deleted: the load
    raises ``MalformedStateError`` and changes nothing, or loads a state that computes."""
    saved = json.loads(json.dumps(filled().state_dict()))
    path = data.draw(st.sampled_from(_paths(saved)))
    node = saved
    for key in path[:-1]:
        node = node[key]
    if data.draw(st.booleans()):
        del node[path[-1]]
    else:
        node[path[-1]] = data.draw(JUNK)
    tracker = Tracker()
    tracker.mean("kept", 1.0)
    before = tracker.state_dict()
    try:
        tracker.load_state_dict(saved)
    except MalformedStateError:
        assert tracker.state_dict() == before
    else:
        tracker.compute()


# -- a user kind's extra of every documented type round-trips ---------------------------
class Sketch:
    """A user's payload object (neither a container nor a number)."""

    def __init__(self, values: list[float]) -> None:
        self.values = sorted(values)

    def __eq__(self, other: object) -> bool:
        return type(other) is Sketch and other.values == self.values

    def __hash__(self) -> int:
        return hash(tuple(self.values))


# per format: (values -> extra, extra -> values); the second raises when the extra came
# back as another type
def _checked(kind: type, read: Callable[[Any], list[float]]) -> Callable[[Any], list[float]]:
    def values(extra: Any) -> list[float]:
        if type(extra) is not kind:
            raise TypeError(f"the extra came back as {type(extra).__name__}, not {kind.__name__}")
        return read(extra)

    return values


FORMATS: dict[str, tuple[Callable[[list[float]], Any], Callable[[Any], list[float]]]] = {
    "tuple": (tuple, _checked(tuple, list)),
    "list": (list, _checked(list, list)),
    "set": (set, _checked(set, sorted)),
    "frozenset": (frozenset, _checked(frozenset, sorted)),
    "dict": (
        lambda v: {x: v.count(x) for x in v},
        _checked(dict, lambda d: [x for x, n in d.items() for _ in range(n)]),
    ),
    "ndarray": (
        lambda v: np.array(v, dtype=np.float64),
        _checked(np.ndarray, lambda a: a.tolist()),
    ),
    "nested": (  # a dict of a list of arrays and a count
        lambda v: {"pieces": [np.array(v)], "count": len(v)},
        _checked(dict, lambda d: [x for a in _checked(list, list)(d["pieces"]) for x in a]),
    ),
    "object": (Sketch, _checked(Sketch, lambda s: s.values)),
}


class Kept(ExtraKind):
    """Keeps every selected value, in an extra of the given python type."""

    num_sums = 1

    def __init__(self, fmt: str) -> None:
        self.name = f"test_sd_kept_{fmt}"
        self.make, self.read = FORMATS[fmt]

    def reduce(self, batch: Batch) -> tuple[Any, Any]:
        return batch.columns(batch.count()), batch.columns()

    def reduce_extra(self, batch: Batch) -> list[Any]:
        pieces = zip(batch.split(batch.values), batch.split(batch.selected()), strict=True)
        if batch.on_host:
            return [self.make(values[kept].tolist()) for values, kept in pieces]
        return list(pieces)

    def empty_extra(self) -> Any:
        return self.make([])

    def host_extra(self, dev_extra: Any) -> Any:
        return self.make([x for values, kept in dev_extra or [] for x in values[kept].tolist()])

    def merge_extra(self, a: Any, b: Any) -> Any:
        return self.make(self.read(a) + self.read(b))

    def result(self, state: MetricState, name: str = "") -> dict[str, float] | None:
        values = self.read(state.extra)
        if not values:
            return None
        return {"n": float(len(values)), "sum": math.fsum(values), "max": max(values)}


KEPT = {fmt: Kept(fmt) for fmt in FORMATS}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_user_kinds_extra_of_every_documented_type_round_trips(fmt: str) -> None:
    """state_dict() then load_state_dict() (through JSON where the dict is plain, else
    pickle) gives back an extra of the same type and numbers; the restored tracker
    merges more steps and computes as if never saved, equal to numpy on the whole batch."""
    kind = KEPT[fmt]
    first, second = [0.5, 2.0, 2.0, -1.0], [3.0, 0.5]
    original = Tracker()
    original.log("kept", first, kind=kind.name)
    extra = original.state().metrics["kept"].extra
    saved = original.state_dict()
    plain = pickle.loads(pickle.dumps(saved)) if fmt == "object" else json.loads(json.dumps(saved))
    restored = Tracker()
    restored.load_state_dict(plain)
    again = restored.state().metrics["kept"].extra
    assert type(again) is type(extra)
    assert kind.read(again) == kind.read(extra)
    for t in (original, restored):
        t.log("kept", second, kind=kind.name)
    whole = np.array(first + second)
    if fmt in ("set", "frozenset"):
        whole = np.unique(whole)
    want = {"kept/n": float(whole.size), "kept/sum": float(whole.sum()), "kept/max": whole.max()}
    assert restored.compute() == original.compute() == want


@pytest.mark.parametrize("fmt", ["list", "dict", "nested"])
def test_a_user_kinds_extra_round_trips_through_a_window(fmt: str) -> None:
    kind = KEPT[fmt]
    tracker = Tracker()
    window = Window(tracker, every=None)
    tracker.log("kept", [1.0, 4.0], kind=kind.name)
    window.step()
    restored = Window(Tracker(), every=None)
    restored.load_state_dict(json.loads(json.dumps(window.state_dict())))
    assert restored.flush() == window.flush() == {"kept/n": 2.0, "kept/sum": 5.0, "kept/max": 4.0}


EXTRAS = {
    "numbers": (1.5, -2, math.inf, None, "label"),
    "numpy scalars": (np.float64(2.5), np.int64(3), np.bool_(True), np.array(4.0)),
    "arrays": (np.arange(6.0).reshape(2, 3), np.zeros((0, 3)), np.array([1, 2], dtype=np.int32)),
    "nested": [{1.5: [np.array([1.0, 2.0])], "k": {frozenset({1, 2}), (3, 4)}}, ((),)],
    "a dict with a tag's key": {"array": [1.0], "list": (2.0,)},
}


@pytest.mark.parametrize("label", list(EXTRAS))
def test_an_extra_keeps_its_types_and_numbers_through_json(label: str) -> None:
    """Every documented python type of an extra, nested, with numbers compared exactly:
    the TrackerState read back from the JSON of its to_dict() holds an equal extra."""
    from rlmetrics import TrackerState

    extra = EXTRAS[label]
    state = TrackerState({"x": MetricState("some_user_kind", (1.0,), (), extra)})
    again = TrackerState.from_dict(json.loads(json.dumps(state.to_dict())))
    _assert_same(again.metrics["x"].extra, extra)


def _assert_same(got: Any, want: Any) -> None:
    """Equal values of the same types, all the way down."""
    assert type(got) is type(want), (got, want)
    if isinstance(want, np.ndarray | np.generic):
        assert got.dtype == want.dtype and np.shape(got) == np.shape(want)
        assert np.array_equal(got, want)
    elif isinstance(want, tuple | list):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            _assert_same(a, b)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            _assert_same(got[key], want[key])
    else:
        assert got == want
