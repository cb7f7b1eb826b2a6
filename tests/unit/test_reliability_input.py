"""Bad and extreme input: each gets a clear error or a documented result, and what was
accumulated before stays intact. Extends tests/unit/test_tracker.py and
tests/unit/kinds/test_kinds.py
(which cover non-numeric values, bad weights, shape mismatches and the basic policies).
"""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
import torch

from rlmetrics import RejectedInputError, Tracker
from rlmetrics.loggers import JsonlLogger

from helpers import reference

NAN, INF = math.nan, math.inf
pytestmark = pytest.mark.usefixtures("log_path")  # host and tensor paths
KINDS = ("mean", "sum", "max", "min", "std", "last", "dist")
GOOD = [1.0, 3.0]


def same(actual: dict, expected: dict) -> None:
    """Equal keys; values equal to 1e-12, NaN equal to NaN."""
    assert actual.keys() == expected.keys(), (actual, expected)
    for key, value in expected.items():
        if math.isnan(value):
            assert math.isnan(actual[key]), key
        else:
            assert actual[key] == pytest.approx(value, rel=1e-12, abs=0), key


def with_good(kind: str, policy: str) -> Tracker:
    """A tracker holding GOOD for ``kind`` (a python float and a tensor) and a bystander."""
    t = Tracker(nonfinite=policy)
    if kind == "last":
        t.last("m", GOOD[-1])
    else:
        t.log("m", GOOD[0], kind=kind)
        t.log("m", torch.tensor(GOOD[1:]), kind=kind)
    t.sum("bystander", 5.0)
    return t


def expected_good(kind: str) -> dict:
    return {**reference(kind, "m", np.array(GOOD[-1:] if kind == "last" else GOOD), None)}


# -- non-finite values: every kind, every policy, python and tensor --------------------------
FORMS = {
    "python": lambda bad: bad,
    "tensor": lambda bad: torch.tensor([bad]),
    "0-d tensor": lambda bad: torch.tensor(bad),  # read at the call, recorded as a number
}


@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_propagate_gives_numpys_answer(kind: str, form: str, bad: float) -> None:
    """propagate: the arithmetic decides, exactly as numpy on all the values."""
    t = with_good(kind, "propagate")
    t.log("m", FORMS[form](bad), kind=kind)
    values = np.array([bad] if kind == "last" else [*GOOD, bad])
    with np.errstate(invalid="ignore"):
        expected = reference(kind, "m", values, None)
    same(t.compute(), {**expected, "bystander": 5.0})


@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_skip_drops_and_counts(kind: str, form: str, bad: float) -> None:
    """skip: the value is dropped (last keeps the previous one) and counted."""
    t = with_good(kind, "skip")
    t.log("m", FORMS[form](bad), kind=kind)
    expected = {**expected_good(kind), "m/nonfinite_count": 1.0, "bystander": 5.0}
    same(t.compute(), expected)


@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("kind", KINDS)
def test_error_policy_raises_naming_the_metric_and_keeps_the_rest(kind: str, bad: float) -> None:
    """error: a python value raises at once; a tensor call, 0-d ones included, is dropped
    and reported at compute() (no host sync at log time). Either way the step's other
    values survive."""
    t = with_good(kind, "error")
    with pytest.raises(ValueError, match=r"metric 'm': non-finite value"):
        t.log("m", bad, kind=kind)
    t.log("m", torch.tensor([bad]), kind=kind)
    t.log("m", torch.tensor(bad), kind=kind)
    with pytest.raises(RejectedInputError, match=rf"'m' \({kind}\): 2"):
        t.compute()
    same(t.compute(), {**expected_good(kind), "bystander": 5.0})


# -- dtypes ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "weight", "what"),
    [
        (np.complex128(1 + 1j), None, "value"),
        (np.array([1j, 2.0]), None, "value"),
        (torch.ones(2), torch.tensor([1j, 1.0]), "weight"),
        (torch.ones(2), np.array([1j, 1.0]), "weight"),
        (1.0, 2j, "weight"),
    ],
    ids=["np_scalar", "np_array", "tensor_weight", "np_weight", "python_weight"],
)
def test_complex_values_and_weights_are_type_errors(value, weight, what) -> None:
    t = with_good("mean", "propagate")
    with pytest.raises(TypeError, match=rf"metric 'm': {what} must be real"):
        t.mean("m", value, weight=weight)
    with pytest.raises(TypeError, match=r"metric 'fresh': .* must be real"):
        t.mean("fresh", value, weight=weight)
    assert "fresh" not in t
    same(t.compute(), {**expected_good("mean"), "bystander": 5.0})


@pytest.mark.parametrize("kind", KINDS)
def test_bool_values_count_as_zero_and_one(kind: str) -> None:
    """Documented: bool values (python, numpy, tensor) are 0.0 and 1.0."""
    bits = [True, False, True, True]
    t = Tracker()
    if kind == "last":
        t.last("py", True)
        t.last("np", np.bool_(False))
        t.last("t", torch.tensor(True))
        assert t.compute() == {"py": 1.0, "np": 0.0, "t": 1.0}
        return
    t.log("t", torch.tensor(bits), kind=kind)
    t.log("np", np.array(bits), kind=kind)
    for bit in bits:
        t.log("py", bit, kind=kind)
    expected = reference(kind, "x", np.array(bits, dtype=np.float64), None)
    out = t.compute()
    for name in ("t", "np", "py"):
        got = {k.replace(name, "x", 1): v for k, v in out.items() if k.split("/")[0] == name}
        same(got, expected)


def test_integer_sums_never_wrap_they_are_float64() -> None:
    """Documented: integers become float64 before anything is added, so nothing wraps
    around; a result is exact while it stays within 2**53 and otherwise the nearest
    float64 (int64 max rounds up to 2**63)."""
    i32, i64 = 2**31 - 1, 2**63 - 1
    t = Tracker()
    t.sum("int32", torch.full((3,), i32, dtype=torch.int32))  # int32 sum would wrap
    t.sum("int64", torch.full((2,), i64, dtype=torch.int64))  # int64 sum would wrap
    t.sum("int64_np", np.full(4, 2**62, dtype=np.int64))
    t.sum("uint8", torch.tensor([200, 200], dtype=torch.uint8))  # uint8 sum would wrap
    t.mean("int8", torch.tensor([127, 127, -128], dtype=torch.int8))
    t.sum("python_int", 2**80)
    t.sum("python_int", 1)  # lost to rounding: 2**80 + 1 is not a float64
    t.max("near_max", torch.tensor([i64], dtype=torch.int64))
    assert t.compute() == {
        "int32": 3.0 * i32,  # 6442450941, exact
        "int64": 2.0**64,  # each element rounds to 2**63
        "int64_np": 2.0**64,  # exact
        "uint8": 400.0,
        "int8": 126 / 3,
        "python_int": 2.0**80,
        "near_max": 2.0**63,
    }


def test_python_int_beyond_float64_is_a_value_error_naming_the_metric() -> None:
    t = with_good("mean", "propagate")
    for value, weight, what in ((10**400, None, "value"), (1, 10**400, "weight")):
        with pytest.raises(ValueError, match=rf"metric 'm': {what} is out of float64's range"):
            t.mean("m", value, weight=weight)
        with pytest.raises(ValueError, match=rf"metric 'new': {what} is out of float64's range"):
            t.mean("new", value, weight=weight)
    assert "new" not in t
    same(t.compute(), {**expected_good("mean"), "bystander": 5.0})


# -- shapes and weights ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value",
    [torch.zeros(0), torch.ones(2), np.ones((2, 1)), [1.0, 2.0], torch.ones(3, 3)],
    ids=["empty", "pair", "column", "list", "matrix"],
)
def test_last_needs_exactly_one_value(value: object) -> None:
    t = with_good("last", "propagate")
    with pytest.raises(ValueError, match=r"metric 'm' \(kind 'last'\) takes one value, got"):
        t.last("m", value)
    with pytest.raises(ValueError, match=r"metric 'new' \(kind 'last'\) takes one value"):
        t.last("new", value)
    assert "new" not in t
    t.last("one_element", np.ones((1, 1)) * 0.5)  # any shape with one element is fine
    same(t.compute(), {**expected_good("last"), "bystander": 5.0, "one_element": 0.5})


@pytest.mark.parametrize("kind", ["mean", "sum", "max", "min", "std", "dist"])
def test_weights_never_broadcast(kind: str) -> None:
    """A weight of shape (1,) or (3, 1) for 3 values is an error, not a broadcast."""
    t = with_good(kind, "propagate")
    for weight in (torch.ones(1), torch.ones(3, 1), np.ones((1, 3))):
        with pytest.raises(ValueError, match=r"metric 'm': weight shape .* does not match"):
            t.log("m", torch.ones(3), weight, kind=kind)
    same(t.compute(), {**expected_good(kind), "bystander": 5.0})


@pytest.mark.parametrize("kind", ["mean", "sum", "max", "min", "std", "dist"])
@pytest.mark.parametrize("policy", ["propagate", "skip", "error"])
def test_negative_tensor_weights_are_rejected_under_every_policy(kind: str, policy: str) -> None:
    t = with_good(kind, policy)
    t.log("m", torch.tensor([100.0, 200.0]), torch.tensor([1.0, -0.5]), kind=kind)
    with pytest.raises(RejectedInputError, match=rf"'m' \({kind}\): 1"):
        t.compute()
    same(t.compute(), {**expected_good(kind), "bystander": 5.0})


@pytest.mark.parametrize("empty", ["omit", "nan"])
@pytest.mark.parametrize("kind", ["mean", "sum", "max", "min", "std", "dist", "last"])
def test_a_metric_only_rejected_tensor_calls_created_is_never_reported(
    kind: str, empty: str
) -> None:
    """As a python call that raises creates no metric: after the rejection is reported,
    the metric is gone (no NaN under empty="nan"), while one that also took a good call
    (a tensor or a python number) stays with that call's value."""
    t = Tracker(empty=empty, nonfinite="error")
    t.sum("bystander", 5.0)
    t.log("python_first", 3.0, kind=kind)
    for name in ("only_rejected", "then_tensor", "then_python", "python_first"):
        t.log(name, torch.tensor([2.0]), torch.tensor([-1.0]), kind=kind)
        t.log(name, torch.tensor([NAN]), kind=kind)
    t.log("then_tensor", torch.tensor([3.0]), torch.tensor([1.0]), kind=kind)
    t.log("then_python", 3.0, kind=kind)
    with pytest.raises(RejectedInputError, match=rf"'only_rejected' \({kind}\): 2"):
        t.compute()
    assert "only_rejected" not in t
    expected = {}
    for name in ("then_tensor", "then_python", "python_first"):
        expected.update(reference(kind, name, np.array([3.0]), None))
    same(t.compute(), {**expected, "bystander": 5.0})


def test_a_rejected_metric_is_dropped_through_state_too() -> None:
    t = Tracker(empty="nan")
    t.mean("m", torch.tensor([1.0]), weight=torch.tensor([-1.0]))
    with pytest.raises(RejectedInputError):
        t.state()
    assert len(t) == 0 and t.compute() == {}


@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("policy", ["propagate", "skip", "error"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_metric_of_zero_d_tensors_only_follows_the_policy(
    kind: str, policy: str, bad: float
) -> None:
    """A metric that only 0-d CPU tensors log: its finite ones take the python number's
    path; a non-finite one still follows the tensor rules: spread (propagate), dropped
    and counted (skip), rejected at compute() and never raised at the call (error)."""
    t = Tracker(nonfinite=policy)
    t.log("m", torch.tensor(GOOD[0]), kind=kind)
    t.log("m", torch.tensor(bad), kind=kind)
    t.log("m", torch.tensor(GOOD[1]), kind=kind)
    t.sum("bystander", 5.0)
    if policy == "propagate":
        values = np.array(GOOD[1:] if kind == "last" else [GOOD[0], bad, GOOD[1]])
        with np.errstate(invalid="ignore"):
            expected = reference(kind, "m", values, None)
        same(t.compute(), {**expected, "bystander": 5.0})
        return
    expected = {**expected_good(kind), "bystander": 5.0}
    if policy == "skip":
        expected["m/nonfinite_count"] = 1.0
    else:
        with pytest.raises(RejectedInputError, match=rf"'m' \({kind}\): 1"):
            t.compute()
    same(t.compute(), expected)


# -- 0-d arrays and masked arrays ---------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_zero_d_numpy_arrays_are_numbers(kind: str) -> None:
    t = Tracker()
    t.log("m", 3.0, np.array(2.0), kind=kind)
    t.log("m", np.array(5.0), np.array(1), kind=kind)
    t.log("m", np.array(7, dtype=np.int32), kind=kind)
    t.log("m", np.float32(9.0), np.array(True), kind=kind)
    x, w = np.array([3.0, 5.0, 7.0, 9.0]), np.array([2.0, 1.0, 1.0, 1.0])
    same(
        t.compute(),
        reference(kind, "m", x[-1:], None) if kind == "last" else reference(kind, "m", x, w),
    )


@pytest.mark.parametrize("kind", KINDS)
def test_zero_d_cpu_tensors_log_their_numbers_in_call_order(kind: str) -> None:
    """A 0-d CPU tensor is read at its call (the copy guarantee) and recorded as its
    number; between python numbers and arrays, in every float dtype, with and without a
    weight, each call keeps its place (``last`` reads the order)."""
    dtypes = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64)
    calls: list[tuple[object, object]] = [
        (torch.tensor(1.5, dtype=dtypes[0]), None),
        (2.0, None),
        (torch.tensor(-0.75, dtype=dtypes[1]), None),
        (torch.tensor([4.0, 8.0]), torch.tensor([True, False])),
        (torch.tensor(0.5, dtype=dtypes[2]), torch.tensor(3.0)),
        (torch.tensor(6.0, dtype=dtypes[3]), None),
        (torch.tensor(-3, dtype=dtypes[4]), 2.0),
    ]
    values, weights = [1.5, 2.0, -0.75, 4.0, 8.0, 0.5, 6.0, -3.0], [1, 1, 1, 1, 0, 3, 1, 2]
    if kind == "last":  # one value a call: the 1-d call is left out
        del calls[3], values[3:5], weights[3:5]
    t = Tracker()
    for value, weight in calls:
        t.log("m", value, weight, kind=kind)
    x, w = np.array(values), np.array(weights, dtype=np.float64)
    expected = reference(kind, "m", x[-1:], None) if kind == "last" else reference(kind, "m", x, w)
    same(t.compute(), expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("weighted", [False, True])
def test_numpy_masked_arrays_honour_their_mask(kind: str, weighted: bool) -> None:
    """Masked elements weigh 0 (a mean of [1, masked 100] is 1, not 50.5); a masked
    weight weighs 0 where it is masked."""
    data = np.array([1.0, 100.0, 3.0, NAN, 4.0])
    mask = np.array([False, True, False, True, False])
    weights = np.array([2.0, 5.0, 1.0, 1.0, 3.0]) if weighted else np.ones(5)
    t = Tracker(nonfinite="error")
    if kind == "last":
        t.last("m", 2.0)
        t.last("m", np.ma.array([7.0], mask=[True]))
        same(t.compute(), {"m": 2.0})
        return
    weight = weights if weighted else None
    t.log("m", np.ma.array(data, mask=mask), weight, kind=kind)
    weight_mask = np.array([False, False, True, False, False])
    t.log("m", data[[0, 2]], np.ma.array(weights[[0, 2]], mask=weight_mask[[0, 2]]), kind=kind)
    x = np.concatenate([data[~mask], data[[0]]])
    w = np.concatenate([weights[~mask], weights[[0]]])
    same(t.compute(), reference(kind, "m", x, w if weighted else None))


def test_a_masked_array_with_a_device_weight_names_the_metric() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a device tensor")
    t = Tracker()
    with pytest.raises(TypeError, match="metric 'm': a numpy masked array's weight"):
        t.mean("m", np.ma.array([1.0], mask=[True]), weight=torch.ones(1, device="cuda"))


# -- names ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "error", "message"),
    [
        (None, TypeError, "metric names must be strings, got NoneType"),
        (b"loss", TypeError, "metric names must be strings, got bytes"),
        (("a",), TypeError, "metric names must be strings, got tuple"),
        ({"a": 1}, TypeError, "metric names must be strings, got dict"),
        (1.5, TypeError, "metric names must be strings, got float"),
        ("", ValueError, "metric names must not be empty"),
    ],
)
def test_bad_names_on_every_path(name: object, error: type, message: str) -> None:
    t = with_good("mean", "propagate")
    for log in (
        lambda: t.mean(name, 1.0),
        lambda: t.last(name, torch.tensor(1.0)),
        lambda: t.log(name, [1.0], kind="dist"),
        lambda: t.prefixed("p/").sum(name, 1.0),
    ):
        with pytest.raises(error, match=message):
            log()
    with pytest.raises(ValueError, match="metric names must not be empty"):
        t.prefixed("").mean("", 1.0)
    assert len(t) == 2
    same(t.compute(), {**expected_good("mean"), "bystander": 5.0})


ODD_NAMES = [
    "x" * 10_000,
    "指标/损失",
    "émoji/🚀🔥",
    "rtl/مرحبا",
    "combining/e\u0301",
    "nul/\x00/byte",
    "line\nbreak",
    " ",
    "../../etc/passwd",
    'quote"and\\backslash',
]


def test_long_and_unicode_names_survive_compute_state_dict_and_jsonl(tmp_path) -> None:
    t = Tracker()
    for i, name in enumerate(ODD_NAMES):
        t.mean(name, float(i))
        t.prefixed(name).sum("/n", torch.tensor([i, 1.0]))
    restored = Tracker()
    restored.load_state_dict(json.loads(json.dumps(t.state_dict())))
    out = t.compute()
    expected = {name: float(i) for i, name in enumerate(ODD_NAMES)}
    expected |= {name + "/n": i + 1.0 for i, name in enumerate(ODD_NAMES)}
    assert out == expected
    assert restored.compute() == expected
    logger = JsonlLogger(tmp_path / "run" / "metrics.jsonl")
    logger.log(1, out)
    logger.close()
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert row == {"step": 1, **expected}
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["metrics.jsonl", "run"]


def test_ten_thousand_metrics_log_and_compute_in_reasonable_time() -> None:
    """10,000 names (python floats and small tensors, four kinds): exact, and fast
    enough for a step (generous bounds: this machine is shared)."""
    kinds = ("mean", "sum", "max", "min")
    t = Tracker()
    start = time.perf_counter()
    for i in range(10_000):
        kind = kinds[i % 4]
        t.log(f"m/{i:05d}", float(i), kind=kind)
        t.log(f"m/{i:05d}", torch.tensor([i + 0.5, i - 0.5]) if i % 10 == 0 else i + 1.0, kind=kind)
    log_s = time.perf_counter() - start
    start = time.perf_counter()
    out = t.compute()
    compute_s = time.perf_counter() - start
    assert len(out) == 10_000
    for i in range(10_000):
        second = [i + 0.5, i - 0.5] if i % 10 == 0 else [i + 1.0]
        values = [float(i), *second]
        expected = {
            "mean": sum(values) / len(values),
            "sum": sum(values),
            "max": max(values),
            "min": min(values),
        }[kinds[i % 4]]
        assert out[f"m/{i:05d}"] == expected, i
    assert log_s < 10.0, log_s
    assert compute_s < 10.0, compute_s


# -- inference tensors: torch counts no in-place change to them ------------------------------
@pytest.mark.parametrize("kind", ["mean", "sum", "max", "std", "dist"])
@pytest.mark.parametrize("weighted", ["none", "tensor", "number", "mask", "shared", "by"])
@pytest.mark.parametrize("inside", [False, True], ids=["logged_after", "logged_inside"])
def test_inference_tensors_are_logged_as_they_were(kind: str, weighted: str, inside: bool) -> None:
    """Rollouts are often made under ``torch.inference_mode()``; reading such a tensor's
    version counter raises torch's error, which named no metric. The record is a copy (as
    a numpy array's is), so a later in-place change, which torch lets pass unnoticed under
    inference mode, cannot reach it: the fold reports the values as logged."""
    x = np.array([0.5, -1.0, 3.0, 2.0, 7.0, 1.5])
    w = np.array([1.0, 0.0, 2.0, 0.5, 1.0, 3.0])
    with torch.inference_mode():
        value, weight = torch.tensor(x), torch.tensor(w)
        labels = torch.tensor([0, 0, 1, 1, 0, 1])
    t = Tracker()
    with torch.inference_mode(inside):
        if weighted == "none":
            t.log("m", value, kind=kind)
        elif weighted == "tensor":
            t.log("m", value, weight, kind=kind)
            t.log("m", value, weight, kind=kind)  # the checked weight, logged again
        elif weighted == "number":
            t.log("m", value, 2.0, kind=kind)
        elif weighted == "mask":
            t.log("m", value, mask=weight > 0, kind=kind)
        elif weighted == "shared":
            t.log_shared([("m", kind)], value, weight)
        else:
            t.log("m", value, weight, by=labels, labels={0: "a", 1: "b"}, kind=kind)
        with torch.inference_mode():
            value.mul_(10.0)  # after the log call: not seen by the record
            weight.add_(1.0)
            labels.fill_(0)
    expected = {
        "none": reference(kind, "m", x, None),
        "tensor": reference(kind, "m", np.r_[x, x], np.r_[w, w]),
        "number": reference(kind, "m", x, np.full_like(x, 2.0)),
        "mask": reference(kind, "m", x, w > 0),
        "shared": reference(kind, "m", x, w),
        "by": {
            **reference(kind, "m/a", x[[0, 1, 4]], w[[0, 1, 4]]),
            **reference(kind, "m/b", x[[2, 3, 5]], w[[2, 3, 5]]),
        },
    }[weighted]
    same(t.compute(), expected)


# -- tensor subclasses with a dispatch of their own -------------------------------------------
@pytest.fixture
def one_rank_group(tmp_path):
    """A one-process gloo group (a file store: no port), destroyed after the test."""
    import torch.distributed as tdist

    store = tdist.FileStore(str(tmp_path / "store"), 1)
    tdist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        tdist.destroy_process_group()


def _fake_tensor() -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.ones(4)


def _dtensor() -> torch.Tensor:
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    return distribute_tensor(torch.arange(4.0), DeviceMesh("cpu", [0]), [Shard(0)])


@pytest.mark.parametrize("role", ["value", "weight", "by"])
@pytest.mark.parametrize("make", [_fake_tensor, _dtensor], ids=["FakeTensor", "DTensor"])
def test_a_tensor_subclass_with_its_own_dispatch_is_refused_naming_the_metric(
    make, role: str, request
) -> None:
    """A DTensor (its elements spread over ranks: the fold's torch operations on it need
    collectives) or a FakeTensor (no data) raised torch's error at compute(), naming no
    metric, and lost the metric's step; the log call now refuses it, saying what to log."""
    if make is _dtensor:
        request.getfixturevalue("one_rank_group")
    tensor = make()
    t = Tracker()
    t.sum("kept", 2.0)
    args = {
        "value": (tensor, None, None),
        "weight": (torch.ones(4), tensor, None),
        "by": (torch.ones(4), None, tensor.to(torch.int64)),
    }[role]
    what = "a by= tensor" if role == "by" else role
    with pytest.raises(TypeError, match=rf"metric 'm': {what} .*{type(tensor).__name__}"):
        t.mean("m", args[0], weight=args[1], by=args[2])
    assert t.compute() == {"kept": 2.0}


# -- CPU tensors changed where torch's version counter cannot see -----------------------------
UNSEEN = ("from_numpy buffer", "tensor.numpy()", "tensor.data")


def _unseen_change(how: str, tensor: torch.Tensor, buffer: np.ndarray) -> None:
    """Change ``tensor`` (made by ``torch.from_numpy(buffer)``) without moving its version
    counter: through the numpy buffer behind it, through ``tensor.numpy()`` or through
    ``tensor.data``; a bool tensor is negated, any other multiplied by 3."""
    version = tensor._version
    flip = tensor.dtype == torch.bool
    if how == "from_numpy buffer":
        buffer[...] = ~buffer if flip else buffer * 3
    elif how == "tensor.numpy()":
        view = tensor.numpy()
        view[...] = ~view if flip else view * 3
    else:
        tensor.data.logical_not_() if flip else tensor.data.mul_(3)
    assert tensor._version == version  # torch sees nothing


@pytest.mark.parametrize("how", UNSEEN)
@pytest.mark.parametrize("role", ["value", "weight", "mask", "by", "0-d value", "0-d weight"])
def test_a_cpu_tensor_changed_unseen_after_the_call_logs_its_values_at_the_call(
    role: str, how: str
) -> None:
    """A reused numpy rollout buffer (``torch.from_numpy``), a write through
    ``tensor.numpy()`` or ``tensor.data.mul_()`` changes a tensor without moving its
    version counter, so the fold could not tell: the record is a copy of the CPU
    tensor's values at the call, as a numpy array's is, and the step reports numpy's
    sums over those values (a weighted sum, and per label with ``by=``)."""
    x = np.array([0.5, -1.0, 3.0, 2.0, 7.0, 1.5])
    w = np.array([1.0, 0.0, 2.0, 0.5, 1.0, 3.0])
    mask = np.array([True, False, True, True, False, True])
    labels = np.array([0, 0, 1, 1, 0, 1])
    scalar = role.startswith("0-d")
    arrays = {"value": x[3:4].reshape(()) if scalar else x.copy(), "weight": w.copy()}
    arrays["weight"] = w[2:3].reshape(()).copy() if scalar else arrays["weight"]
    if role == "mask":
        arrays["weight"] = mask.copy()
    if role == "by":
        arrays["by"] = labels.copy()
    expected_arrays = {key: array.copy() for key, array in arrays.items()}
    tensors = {key: torch.from_numpy(array) for key, array in arrays.items()}
    t = Tracker()
    t.sum("m", tensors["value"], tensors["weight"], by=tensors.get("by"))
    changed = {"0-d value": "value", "0-d weight": "weight", "mask": "weight"}.get(role, role)
    _unseen_change(how, tensors[changed], arrays[changed])
    t.sum("m", tensors["value"], tensors["weight"], by=tensors.get("by"))  # the values now
    now = {key: array.copy() for key, array in arrays.items()}
    expected: dict[str, float] = {}
    if role == "by":
        for label in (0, 1, 3):
            rows = [(v[b == label], ww[b == label]) for v, ww, b in (
                (expected_arrays["value"], expected_arrays["weight"], expected_arrays["by"]),
                (now["value"], now["weight"], now["by"]),
            )]  # fmt: skip
            if any(v.size for v, _ in rows):
                value = np.concatenate([v for v, _ in rows])
                weight = np.concatenate([ww for _, ww in rows])
                expected.update(reference("sum", f"m/{label}", value, weight))
    else:
        value = np.r_[expected_arrays["value"].reshape(-1), now["value"].reshape(-1)]
        weight = np.r_[expected_arrays["weight"].reshape(-1), now["weight"].reshape(-1)]
        expected = reference("sum", "m", value, weight)
    same(t.compute(), expected)


@pytest.mark.parametrize("how", UNSEEN)
@pytest.mark.parametrize("role", ["value", "weight", "mask"])
def test_a_cpu_tensor_logged_again_and_changed_unseen_logs_its_values_at_each_call(
    role: str, how: str
) -> None:
    """The host path copies a CPU tensor from its memory: through a view of that memory
    from its second read on, and a weight equal to its last copy is recorded as that
    copy again. Logged five times, changed unseen before calls 1, 3 and 4 (so one call
    logs it unchanged), the step reports numpy's weighted sum over its values at each
    call."""
    x = np.array([0.5, -1.0, 3.0, 2.0, 7.0, 1.5])
    w = np.array([1.0, 0.0, 2.0, 0.5, 1.0, 3.0])
    mask = np.array([True, False, True, True, False, True])
    arrays = {"value": x.copy(), "weight": mask.copy() if role == "mask" else w.copy()}
    tensors = {key: torch.from_numpy(array) for key, array in arrays.items()}
    changed = "weight" if role == "mask" else role
    t = Tracker()
    logged = []
    for call in range(5):
        if call in (1, 3, 4):
            _unseen_change(how, tensors[changed], arrays[changed])
        t.sum("m", tensors["value"], tensors["weight"])
        logged.append({key: array.copy() for key, array in arrays.items()})
    value = np.concatenate([now["value"] for now in logged])
    weight = np.concatenate([now["weight"] for now in logged])
    same(t.compute(), reference("sum", "m", value, weight))


def test_a_mask_given_other_data_between_calls_logs_its_values_at_each_call() -> None:
    """``mask.data = other`` (same dtype and shape) moves no version counter: the call
    after it records the new elements, not the last call's copy."""
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    mask = torch.tensor([True, True, False, False])
    t = Tracker()
    t.mean("m", x, weight=mask)
    t.mean("m", x, weight=mask)
    mask.data = torch.tensor([False, False, True, True])
    t.mean("m", x, weight=mask)
    assert t.compute() == {"m": pytest.approx((1 + 2 + 1 + 2 + 3 + 4) / 6)}


# -- tensors of any strides ----------------------------------------------------------------------
SHAPE = (2, 3, 4, 5)


def _channels_last(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.copy()).contiguous(memory_format=torch.channels_last)


def _permuted_nhwc(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a.transpose(0, 2, 3, 1))).permute(0, 3, 1, 2)


def _transposed(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a.transpose(3, 2, 1, 0))).permute(3, 2, 1, 0)


def _sliced_with_steps(a: np.ndarray) -> torch.Tensor:
    big = torch.zeros((2, 3, 8, 15), dtype=torch.from_numpy(a).dtype)
    big[:, :, ::2, ::3] = torch.from_numpy(a)
    return big[:, :, ::2, ::3]


def _expanded(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a[:, :, :, :1].copy()).expand(SHAPE)  # stride 0 on the last


LAYOUTS = {
    "channels_last": _channels_last,
    "permuted NHWC": _permuted_nhwc,
    "transposed": _transposed,
    "sliced with steps": _sliced_with_steps,
    "expanded": _expanded,
}


@pytest.mark.parametrize("by_reference", [False, True], ids=["copied", "by reference"])
@pytest.mark.parametrize("role", ["value", "weight", "by"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_tensors_of_any_strides_log_their_logical_elements(
    layout: str, role: str, by_reference: bool
) -> None:
    """channels_last, a permuted NHWC tensor, a transposed one, one sliced with steps and
    an expanded one (stride 0), as value, weight or ``by=`` labels, next to contiguous
    partners, log their elements in their logical order: numpy's weighted mean and
    distribution over the arrays (the fold joined them with ``view``, which raised
    torch's "view size is not compatible", naming no metric, and lost the step's tensor
    metrics). ``by_reference``: recorded as a device tensor is, not as a copy."""
    rng = np.random.default_rng(11)
    arrays = {
        "value": rng.normal(size=SHAPE),
        "weight": rng.uniform(0.5, 2.0, size=SHAPE),
        "by": rng.integers(0, 3, size=SHAPE),
    }
    make = LAYOUTS[layout]
    if layout == "expanded":  # the logical values: constant along the last dimension
        arrays[role] = np.broadcast_to(arrays[role][:, :, :, :1], SHAPE).copy()
    tensors = {key: torch.from_numpy(array.copy()) for key, array in arrays.items()}
    tensors[role] = make(arrays[role])
    assert not tensors[role].is_contiguous()
    t = Tracker()
    t.copy_cpu_tensors = not by_reference
    t.mean("m", tensors["value"], tensors["weight"], by=tensors["by"])
    t.dist("d", tensors["value"], tensors["weight"] > 1.0)
    t.sum("plain", torch.ones(3))
    x, w, labels = (arrays[key].reshape(-1) for key in ("value", "weight", "by"))
    expected = {"plain": 3.0, **reference("dist", "d", x, w > 1.0)}
    for label in np.unique(labels).tolist():
        expected.update(reference("mean", f"m/{label}", x[labels == label], w[labels == label]))
    same(t.compute(), expected)


# -- a tensor weight given new data by `.data = other` between log calls ------------------------
REBOUND = {  # the weight's first data, and the data `.data = other` gives it
    "bool mask to floats with a negative": ([True, True, False], [1.0, -1.0, 2.0]),
    "floats to another shape": ([1.0, 2.0, 0.5], [2.0, 1.0, 0.0, 3.0, 1.0]),
    "bool mask to another shape": ([True, False, True], [False, True, True, True, False]),
    "floats to ints of another shape": ([1.0, 2.0, 0.5], [2, 1]),
    "floats to complex": ([1.0, 2.0, 0.5], [1 + 1j, 2.0, 1.0]),
    "floats that require grad to other floats": ([1.0, 2.0, 0.5], [0.0, 4.0, 1.0]),
}


@pytest.mark.parametrize("case", REBOUND)
def test_a_weight_given_new_data_by_dot_data_is_checked_as_a_new_tensor(case: str) -> None:
    """``weight.data = other`` gives a logged weight another dtype, shape and values
    without moving its version counter, so a check kept for "the same object at the same
    version" was stale: a bool mask given floats with a negative was never checked (a
    mean of 2.714 where a fresh tensor is rejected), a weight given 5 elements was
    refused for a matching value and accepted for a mismatched one (after which
    ``compute()`` dropped the metric), a weight that requires grad kept its first
    values. Now the rebound weight is checked as a fresh tensor of its new data is:
    numpy's weighted mean over both calls, or the same error."""
    first, then = REBOUND[case]
    x0 = np.array([0.5, 3.0, 7.0])
    x1 = np.arange(1.0, len(then) + 1.0)
    grad = "grad" in case
    w = torch.tensor(first, requires_grad=grad)
    t = Tracker()
    t.mean("m", torch.from_numpy(x0), weight=w)
    version = w._version
    with torch.no_grad():
        w.data = torch.tensor(then)
    assert w._version == version  # torch counts nothing: the records' checks must see it
    if len(then) != len(x0):  # the value of the old shape is refused, as for a fresh weight
        refused = rf"metric 'm': weight shape \({len(then)},\) does not match value shape \(3,\)"
        with pytest.raises(ValueError, match=refused):
            t.mean("m", torch.zeros(3), weight=w)
    fresh = torch.tensor(then)
    if fresh.is_complex():
        with pytest.raises(TypeError, match="metric 'm'") as refused:
            t.mean("m", torch.from_numpy(x1), weight=w)
        with pytest.raises(TypeError) as fresh_refused:
            Tracker().mean("m", torch.from_numpy(x1), weight=fresh)
        assert str(refused.value) == str(fresh_refused.value)
        same(t.compute(), reference("mean", "m", x0, np.array(first, dtype=np.float64)))
        return
    t.mean("m", torch.from_numpy(x1), weight=w)
    weights = np.r_[np.array(first, dtype=np.float64), np.array(then, dtype=np.float64)]
    if (weights < 0).any():
        with pytest.raises(RejectedInputError, match="'m' \\(mean\\): 1"):
            t.compute()
        same(t.compute(), reference("mean", "m", x0, np.array(first, dtype=np.float64)))
    else:
        same(t.compute(), reference("mean", "m", np.r_[x0, x1], weights))


REASON = {
    "value": "with a non-finite value",
    "weight": "with a negative or non-finite weight*",
}
"""The reason a rejection message gives for each rule a call broke."""


@pytest.mark.parametrize(
    ("calls", "counted"),
    [
        ([("value", NAN)], {"value": 1}),
        ([("value", INF), ("value", -INF)], {"value": 2}),
        ([("weight", -1.0)], {"weight": 1}),
        ([("weight", NAN)], {"weight": 1}),
        ([("value", NAN), ("weight", -1.0), ("weight", INF)], {"value": 1, "weight": 2}),
    ],
)
def test_a_rejection_names_the_metric_the_calls_and_the_rule_each_broke(
    calls: list[tuple[str, float]], counted: dict[str, int]
) -> None:
    """Under nonfinite="error" the message tells a non-finite value from a bad weight,
    per metric, with the count of each; the next compute() has every other call, and the
    counts do not carry into it."""
    t = Tracker(nonfinite="error")
    t.mean("ok", torch.tensor(GOOD))
    for rule, bad in calls:
        if rule == "value":
            t.mean("m", torch.tensor([1.0, bad]))
        else:
            t.mean("m", torch.tensor(GOOD), weight=torch.tensor([1.0, bad]))
    t.mean("m", torch.tensor(GOOD))  # a good call of the same metric is kept
    with pytest.raises(RejectedInputError) as info:
        t.compute()
    message = str(info.value)
    parts = [f"{counted[rule]} {REASON[rule]}" for rule in ("value", "weight") if rule in counted]
    assert f"'m' (mean): {len(calls)} ({', '.join(parts)})" in message
    assert "'ok'" not in message
    assert ("*or a negative or non-finite token count" in message) == ("weight" in counted)
    assert t.compute() == {"ok": 2.0, "m": 2.0}
    t.mean("m", torch.tensor([1.0, NAN]))
    with pytest.raises(RejectedInputError, match=r"'m' \(mean\): 1 \(1 with a non-finite value\)"):
        t.compute()


@pytest.mark.parametrize("policy", ["propagate", "skip"])
def test_without_error_a_rejection_is_a_bad_weight(policy: str) -> None:
    """Under the other policies a value is never rejected: every rejected call broke a
    weight's rule (and a skipped element is no rejected call)."""
    t = Tracker(nonfinite=policy)
    t.mean("m", torch.tensor([NAN, 1.0]), weight=torch.tensor([1.0, -1.0]))
    t.mean("m", torch.tensor([NAN, 1.0]))
    with pytest.raises(RejectedInputError, match=r"'m' \(mean\): 1 \(1 with a negative or non"):
        t.compute()
