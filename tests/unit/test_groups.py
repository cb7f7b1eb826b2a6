"""Per-group metrics (``by=``): each label's value equals numpy over the whole batch's
elements of that label, however the batch is cut into calls and ranks; bad labels raise
naming the metric; tensor labels are read at the fold, not at the call."""

from __future__ import annotations

import contextlib
import io
import itertools
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as tdist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from rlmetrics import ModifiedInputError, Tracker

from gloo_ranks import count_collectives, ok_results, run_ranks
from helpers import OpCounter

KINDS = ("mean", "sum", "max", "min", "std")
SOURCES = ("gsm8k", "math", "code")
NAMES = dict(enumerate(SOURCES))  # integer label -> name, for labels=
LABEL_FORMS = ("list", "numpy", "tensor", "tensor+labels")


def expected(kind: str, x: np.ndarray, w: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """numpy over the whole batch: per label with a selected element, the kind's value."""
    out = {}
    for label in np.unique(labels):
        sel = labels == label
        xs, ws = x[sel], w[sel]
        if not (ws > 0).any():
            continue
        picked = xs[ws > 0]
        if kind == "mean":
            value = float(np.sum(xs * ws) / np.sum(ws))
        elif kind == "sum":
            value = float(np.sum(xs * ws))
        elif kind == "max":
            value = float(picked.max())
        elif kind == "min":
            value = float(picked.min())
        else:
            mean = np.sum(xs * ws) / np.sum(ws)
            value = float(np.sqrt(np.sum(ws * (xs - mean) ** 2) / np.sum(ws)))
        out[f"x/{label}"] = value
    return out


def assert_matches(got: dict[str, float], want: dict[str, float]) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def as_labels(form: str, codes: np.ndarray) -> tuple[Any, dict | None]:
    """Integer codes into SOURCES as ``by=`` (and ``labels=``) of the given form."""
    if form == "list":
        return [SOURCES[c] for c in codes], None
    if form == "numpy":
        return np.array(SOURCES, dtype=object)[codes], None
    if form == "tensor":
        return torch.from_numpy(codes), None
    return torch.from_numpy(codes).to(torch.int32), NAMES


def name_of(form: str, code: int) -> str:
    return str(code) if form == "tensor" else SOURCES[code]


@st.composite
def batches(draw: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """A batch (values, weights with zeros, label codes) and cut points into calls."""
    n = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    x = rng.normal(loc=draw(st.sampled_from([0.0, 1e6])), scale=3.0, size=n)
    w = rng.integers(0, 3, size=n).astype(np.float64)
    codes = rng.integers(0, draw(st.integers(1, 3)), size=n)
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=6)))
    return x, w, codes, [0, *cuts, n]


@pytest.mark.parametrize(
    "reduce_host_data_with_numpy", [True, False], ids=["host path", "device path"]
)
@pytest.mark.parametrize("value_form", ["numpy", "tensor"])
@pytest.mark.parametrize("label_form", LABEL_FORMS)
@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=25, deadline=None)
@given(batch=batches())
def test_each_label_equals_numpy_over_the_whole_batch_for_any_split(
    batch: tuple, kind: str, label_form: str, value_form: str, reduce_host_data_with_numpy: bool
) -> None:
    x, w, codes, bounds = batch
    t = Tracker()
    t.reduce_host_data_with_numpy = reduce_host_data_with_numpy
    for lo, hi in itertools.pairwise(bounds):
        value, weight = x[lo:hi], w[lo:hi]
        if value_form == "tensor":
            value, weight = torch.from_numpy(value.copy()), torch.from_numpy(weight.copy())
        by, labels = as_labels(label_form, codes[lo:hi])
        getattr(t, kind)("x", value, weight=weight, by=by, labels=labels)
    names = np.array([name_of(label_form, c) for c in codes])
    assert_matches(t.compute(), expected(kind, x, w, names))


@pytest.mark.parametrize("value_form", ["numpy", "tensor"])
@pytest.mark.parametrize("label_form", LABEL_FORMS)
def test_one_label_per_row_applies_to_the_rows_tokens(label_form: str, value_form: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 5, 2))
    mask = rng.random((6, 5, 2)) > 0.3
    codes = np.array([0, 1, 1, 2, 0, 1])
    t = Tracker()
    for rows in (slice(0, 2), slice(2, 6)):
        by, labels = as_labels(label_form, codes[rows])
        value, weight = x[rows], mask[rows]
        if value_form == "tensor":
            value, weight = torch.from_numpy(value), torch.from_numpy(weight)
        t.mean("x", value, weight=weight, by=by, labels=labels)
        t.max("m", value, weight=weight, by=by, labels=labels)
    names = np.repeat([name_of(label_form, c) for c in codes], 10)
    want = expected("mean", x.ravel(), mask.ravel().astype(float), names)
    want |= {f"m/{k[2:]}": v for k, v in expected("max", x.ravel(), mask.ravel(), names).items()}
    assert_matches(t.compute(), want)


@pytest.mark.parametrize("kind", ["dist", "quantile"])
def test_dist_and_quantile_report_as_if_each_label_were_logged_alone(kind: str) -> None:
    rng = np.random.default_rng(1)
    x, codes = rng.lognormal(size=50), rng.integers(0, 3, size=50)
    t, alone = Tracker(), Tracker()
    for calls in (slice(0, 20), slice(20, 50)):
        by, labels = as_labels("tensor+labels", codes[calls])
        getattr(t, kind)("d", torch.from_numpy(x[calls]), by=by, labels=labels)
    for code, source in NAMES.items():
        getattr(alone, kind)(f"d/{source}", x[codes == code])
    got, want = t.compute(), alone.compute()
    assert set(got) == set(want) and len(want) == 3 * len(alone.kind(kind).result_names())
    assert got == pytest.approx(want, rel=1e-12)


def test_numbers_single_labels_log_shared_prefixes_and_log() -> None:
    t = Tracker()
    t.mean("n", 2.0, by="a")
    t.mean("n", 4.0, weight=3.0, by=7)
    t.prefixed("p/").sum("s", torch.tensor(5.0), by=torch.tensor(1), labels={1: "one"})
    t.log("k", [1.0, 9.0], by=["u", "v"], kind="max")
    t.log_shared([("len/mean", "mean"), ("len/max", "max")], [1.0, 3.0, 8.0], by=["a", "a", "b"])
    assert t.compute() == {
        "k/u": 1.0, "k/v": 9.0, "len/max/a": 3.0, "len/max/b": 8.0, "len/mean/a": 2.0,
        "len/mean/b": 8.0, "n/7": 4.0, "n/a": 2.0, "p/s/one": 5.0,
    }  # fmt: skip


def test_label_sets_change_from_step_to_step() -> None:
    t = Tracker()
    for step, labels in enumerate((["a", "b", "a"], ["c", "c", "b"], ["a", "a", "a"])):
        t.mean("x", torch.tensor([1.0, 2.0, 3.0]) + step, by=torch.tensor([ord(c) for c in labels]),
               labels={ord(c): c for c in "abc"})  # fmt: skip
        t.max("m", [1.0, 2.0, 3.0], by=labels)
        got = t.compute()
        present = sorted(set(labels))
        assert sorted(k for k in got if k.startswith("x/")) == [f"x/{c}" for c in present]
        assert sorted(k for k in got if k.startswith("m/")) == [f"m/{c}" for c in present]
    assert got == {"x/a": 4.0, "m/a": 3.0}


@pytest.mark.parametrize("label_form", LABEL_FORMS)
@pytest.mark.usefixtures("cpu_tensors_by_reference")
def test_a_grouped_tensor_call_dispatches_no_torch_op(label_form: str) -> None:
    t = Tracker()
    value, mask = torch.rand(8, 4), torch.rand(8, 4) > 0.5
    by, labels = as_labels(label_form, np.arange(8) % 3)
    with OpCounter() as counter:
        for _ in range(3):
            t.mean("x", value, weight=mask, by=by, labels=labels)
    assert counter.ops == []
    want = expected("mean", value.double().numpy().ravel(), mask.double().numpy().ravel(),
                    np.repeat([name_of(label_form, c) for c in np.arange(8) % 3], 4))  # fmt: skip
    assert_matches(t.compute(), want)


@pytest.mark.usefixtures("cpu_tensors_by_reference")
def test_deferred_calls_fold_under_the_memory_bound_and_reset_drops_them() -> None:
    t = Tracker()
    t.record_limit = 50
    x = torch.arange(40.0)
    pending = []
    for _ in range(5):  # every second call passes the bound: a fold mid-step
        t.sum("x", x, by=torch.arange(40) % 2)
        pending.append(len(t._groups.pending))
    assert pending == [1, 0, 1, 0, 1]
    assert t.compute() == {"x/0": 5 * 380.0, "x/1": 5 * 400.0}
    t.record_limit = 1 << 22
    t.sum("x", x, by=torch.arange(40) % 2)
    t.reset()
    t.sum("y", 1.0)
    assert t.compute() == {"y": 1.0}


@pytest.mark.parametrize("how", ["in place", "new data of another shape"])
@pytest.mark.parametrize("changed", ["value", "weight", "labels"])
@pytest.mark.usefixtures("cpu_tensors_by_reference")
def test_changing_a_deferred_tensor_in_place_raises(changed: str, how: str) -> None:
    """Also ``tensor.data = other`` of another shape, which keeps the version counter:
    new labels of fewer elements split the value silently, a shorter value or weight
    raised torch's IndexError, naming no metric."""
    tensors = {
        "value": torch.ones(4),
        "weight": torch.ones(4),
        "labels": torch.tensor([0, 1, 0, 1]),
    }
    t = Tracker()
    t.mean("x", tensors["value"], weight=tensors["weight"], by=tensors["labels"])
    t.mean("y", 2.0)
    if how == "in place":
        tensors[changed].add_(1)
    else:
        tensors[changed].data = tensors[changed][:3].clone()  # the same version
    with pytest.raises(ModifiedInputError, match="'x'"):
        t.compute()
    assert t.compute() == {"y": 2.0}  # reported once; the other metric was kept


BAD_CALLS = {  # (by, labels, value, error, message)
    "length": (["a", "b"], None, [1.0, 2.0, 3.0], ValueError, r"by= has shape \(2,\).*\(3,\)"),
    "tensor length": (torch.tensor([0, 1]), None, torch.ones(3), ValueError, "has shape"),
    "per column": (["a", "b"], None, np.ones((3, 2)), ValueError, "has shape"),
    "trailing slash": (["a/", "b"], None, [1.0, 2.0], ValueError, "label 'a/' makes an invalid"),
    "empty": (["", "b"], None, [1.0, 2.0], ValueError, "label '' makes an invalid"),
    "newline": (["a\nb"], None, [1.0], ValueError, "invalid metric name"),
    "float labels": ([0.5, 1.5], None, [1.0, 2.0], TypeError, "strings or integers"),
    "bool labels": ([True, False], None, [1.0, 2.0], TypeError, "strings or integers"),
    "None label": (np.array(["a", None], dtype=object), None, [1, 2], TypeError, "or integers"),
    # mixed python labels, which numpy would turn into strings ("2.5", "True") or ints
    "str and int": (["gsm8k", 1], None, [1, 2], TypeError, "got str 'gsm8k' and int 1"),
    "str and float": (["gsm8k", 2.5], None, [1, 2], TypeError, "one type.*got float 2.5"),
    "int and float": ((0, 2.5), None, [1, 2], TypeError, "got float 2.5"),
    "str and bool": (("gsm8k", True), None, [1, 2], TypeError, "got bool True"),
    "int and bool": ([1, True], None, [1, 2], TypeError, "got bool True"),
    "np bools": ([np.bool_(True)], None, [1], TypeError, "got bool"),
    "nested mixed": ([["a", "b"], ["c", 1]], None, np.ones((2, 2)), TypeError, "int 1"),
    "object int and bool": (np.array([1, True], dtype=object), None, [1, 2], TypeError, "bool"),
    "mixed with labels=": (["a", 1], {"a": "x", 1: "y"}, [1, 2], TypeError, "int 1"),
    "float tensor": (torch.tensor([0.0, 1.0]), None, [1.0, 2.0], TypeError, "integer tensor"),
    "bool tensor": (torch.tensor([True, False]), None, [1.0, 2.0], TypeError, "integer tensor"),
    "meta tensor": (torch.ones(2, dtype=torch.long, device="meta"), None, [1], TypeError, "data"),
    "a set": ({"a", "b"}, None, [1.0, 2.0], TypeError, "by= must be a sequence"),
    "not in labels=": ([0, 2], {0: "a"}, [1.0, 2.0], ValueError, r"label 2 is not in labels="),
    "labels= bad name": ([0], {0: "a//b"}, [1.0], ValueError, "invalid metric name"),
    "labels= not a map": ([0], ["a"], [1.0], TypeError, "labels= must be a mapping"),
    "labels= alone": (None, {0: "a"}, [1.0], TypeError, "pass by= too"),
}


GOOD_LABELS = {  # label forms docs/groups.md promises, each giving groups a and b (or 0 and 1)
    "str list": ["a", "b", "a"],
    "int tuple": (0, 1, 0),
    "numpy scalars in a list": [np.int64(0), 1, np.int32(0)],
    "numpy strings in a list": [np.str_("a"), "b", "a"],
    "object array": np.array(["a", "b", "a"], dtype=object),
    "str array": np.array(["a", "b", "a"]),
    "uint8 array": np.array([0, 1, 0], dtype=np.uint8),
    "int tensor": torch.tensor([0, 1, 0], dtype=torch.int16),
}


@pytest.mark.parametrize("by", GOOD_LABELS.values(), ids=GOOD_LABELS.keys())
def test_label_forms_of_one_type_are_accepted(by) -> None:
    values = np.array([1.0, 2.0, 4.0])
    t = Tracker()
    t.mean("x", values, by=by)
    out = t.compute()
    first, second = sorted(out)  # x/a and x/b, or x/0 and x/1
    assert out == {first: values[[0, 2]].mean(), second: values[1]}


@pytest.mark.parametrize("case", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_bad_labels_raise_naming_the_metric_and_log_nothing(case: tuple) -> None:
    by, labels, value, error, message = case
    t = Tracker()
    with pytest.raises(error, match=message) as info:
        t.mean("critic/score", value, by=by, labels=labels)
    assert "'critic/score'" in str(info.value)
    assert t.compute() == {}


def test_last_and_kind_conflicts_raise() -> None:
    t = Tracker()
    with pytest.raises(TypeError, match="'lr': by= does not apply to kind 'last'"):
        t.last("lr", [1.0], by=["a"])
    t.max("x/b", 5.0)
    with pytest.raises(ValueError, match="'x/b' is already logged as kind 'max'"):
        t.mean("x", [1.0, 2.0], by=["a", "b"])
    t.mean("x", torch.tensor([1.0, 2.0]), by=torch.tensor([0, 1]), labels={0: "a", 1: "b"})
    with pytest.raises(ValueError, match=r"dropped at the fold.*'x/b' is already logged"):
        t.compute()
    assert t.compute() == {"x/b": 5.0}  # the conflicting calls logged nothing


def test_a_label_missing_from_labels_at_the_fold_drops_that_call_only() -> None:
    t = Tracker()
    t.mean("x", torch.tensor([1.0, 2.0]), by=torch.tensor([0, 5]), labels={0: "a"})
    t.mean("y", torch.tensor([1.0, 2.0]), by=torch.tensor([0, 0]), labels={0: "a"})
    with pytest.raises(ValueError, match="metric 'x': label 5 is not in labels="):
        t.compute(reset=False)
    assert t.compute() == {"y/a": 1.5}


# -- real gloo ranks --------------------------------------------------------------------

ALL_SOURCES = ("gsm8k", "math", "rare", "code")
STEPS = (  # per step: (labels of rank 0, labels of the last rank, labels of the others)
    (("gsm8k", "math", "rare"), ("gsm8k", "math"), ("gsm8k",)),  # "rare": rank 0 only
    (("gsm8k", "math", "rare"), ("gsm8k", "math"), ("gsm8k",)),  # steady
    (("gsm8k", "math"), ("code", "math"), ("math",)),  # "rare" gone, "code" new
    (("gsm8k", "math"), ("code", "math"), ("math",)),  # steady again
    (("math",), ("code",), ()),  # fewer labels, all known: still steady; a rank logs none
)
STEADY = (1, 3, 4)  # steps whose names the agreed layout already holds
GROUPED_KINDS = ("mean", "sum", "max", "min", "std")


def rank_batch(step: int, rank: int, world: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This rank's elements of ``step``: values, weights (with zeros), labels."""
    first, last, other = STEPS[step]
    sources = first if rank == 0 else last if rank == world - 1 else other
    rng = np.random.default_rng([step, rank, world])
    n = 0 if not sources else int(rng.integers(3, 9))
    labels = np.array(sources, dtype=object)[rng.integers(0, max(len(sources), 1), size=n)]
    labels[: len(sources)] = sources[:n]  # every listed label present
    x = rng.normal(loc=100.0, size=n)
    w = rng.integers(0, 3, size=n).astype(np.float64)
    w[: len(sources)] = 1.0
    return x, w, labels


def log_rank_step(t: Tracker, step: int, rank: int, world: int) -> None:
    """This rank's step in two micro-batches; each rank passes its labels another way."""
    x, w, labels = rank_batch(step, rank, world)
    codes = np.array([ALL_SOURCES.index(s) for s in labels], dtype=np.int64)
    half = len(x) // 2
    for part in (slice(0, half), slice(half, None)):
        form = rank % 4
        if form == 0:
            by, names = list(labels[part]), None
        elif form == 1:
            by, names = labels[part], None
        else:
            dtype = torch.int64 if form == 2 else torch.int32
            by, names = torch.from_numpy(codes[part]).to(dtype), dict(enumerate(ALL_SOURCES))
        value, weight = torch.from_numpy(x[part]), torch.from_numpy(w[part])
        if form == 1:
            value, weight = x[part], w[part]
        for kind in GROUPED_KINDS:
            getattr(t, kind)(f"score/{kind}", value, weight=weight, by=by, labels=names)
    t.mean("plain", 1.0)


def grouped_steps(rank: int, world: int) -> tuple[list[tuple[dict, int]], int]:
    """Every step's metrics and this rank's collectives, over a group of its own; and
    the collectives of a steady step that logs the same kinds without ``by=``."""

    group, plain_group = (tdist.new_group(list(range(world))) for _ in range(2))
    t, plain = Tracker(), Tracker()
    out = []
    with pytest.MonkeyPatch.context() as patch:
        counts = count_collectives(patch)
        for _ in range(2):
            for kind in GROUPED_KINDS:
                getattr(plain, kind)(f"score/{kind}", torch.ones(3), weight=torch.ones(3))
            before = counts["n"]
            plain.compute(group=plain_group, timeout=60)
            baseline = counts["n"] - before
        for step in range(len(STEPS)):
            log_rank_step(t, step, rank, world)
            before = counts["n"]
            result = t.compute(group=group, timeout=60)
            out.append((result, counts["n"] - before))
    return out, baseline


def whole_batch_expected(step: int, world: int) -> dict[str, float]:
    """numpy over every rank's elements of ``step``, per kind and label."""
    parts = [rank_batch(step, rank, world) for rank in range(world)]
    x, w, labels = (np.concatenate([p[i] for p in parts]) for i in range(3))
    out = {"plain": 1.0}
    for kind in GROUPED_KINDS:
        for key, value in expected(kind, x, w, labels.astype(str)).items():
            out[f"score/{kind}/{key.removeprefix('x/')}"] = value
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_agree_on_every_label_and_steady_steps_add_no_collective(world: int) -> None:
    outcome, baselines = zip(*ok_results(run_ranks(grouped_steps, world, timeout=300)), strict=True)
    baseline = baselines[0]
    assert set(baselines) == {baseline} and baseline == 2  # the packed gather, std's extras
    for step in range(len(STEPS)):
        results = [per_rank[step][0] for per_rank in outcome]
        counts = [per_rank[step][1] for per_rank in outcome]
        assert all(r == results[0] for r in results), f"step {step}: ranks disagree"
        assert_matches(results[0], whole_batch_expected(step, world))
        assert len(set(counts)) == 1, counts
        if step in STEADY:  # no collective beyond a steady step's without by=
            assert counts[0] == baseline, (step, counts)
        else:  # new names: the schema is agreed again
            assert counts[0] > baseline, (step, counts)
    assert "score/max/rare" in outcome[-1][1][0]  # rank world-1 never saw "rare"
    assert "score/mean/code" in outcome[0][2][0]  # rank 0 never sees "code"


def test_the_docs_examples_print_what_they_say() -> None:
    text = (Path(__file__).parents[2] / "docs" / "groups.md").read_text()
    for example in re.findall(r"```python\n(.*?)```", text, re.S):
        said = re.findall(r"^# (.*)$", example, re.M)  # the printed output, as commented
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(example, "docs/groups.md", "exec"), {})
        assert " ".join(out.getvalue().split()) == " ".join(" ".join(said).split())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("label_form", ["list", "tensor+labels"])
def test_cuda_grouped_calls_never_sync_at_the_call_and_match_the_cpu(label_form: str) -> None:
    rng = np.random.default_rng(2)
    x, mask, codes = rng.normal(size=(12, 4)), rng.random((12, 4)) > 0.4, np.arange(12) % 3
    results = []
    for device in ("cpu", "cuda"):
        t = Tracker()
        value = torch.from_numpy(x).to(device)
        weight = torch.from_numpy(mask).to(device)
        by, labels = as_labels(label_form, codes)
        if isinstance(by, Tensor):
            by = by.to(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for kind in KINDS:
                getattr(t, kind)(kind, value, weight=weight, by=by, labels=labels)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results.append(t.compute())
    assert results[0] == pytest.approx(results[1], rel=1e-12)
    assert len(results[0]) == len(KINDS) * 3
