"""Log calls record, the fold reduces: no torch op per log call, a number of torch ops
at compute() that does not grow with the calls, in-place changes caught, memory bound."""

from __future__ import annotations

import functools
import gc
import math
import pickle
import random
import re
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.dlpack import from_dlpack, to_dlpack

from rlmetrics import ModifiedInputError, Tracker

from helpers import OpCounter, reference

KINDS = ("mean", "sum", "max", "min", "std", "last", "dist")


CALLS = {  # (method, inputs made before counting, keyword arguments)
    "0-d tensor": ("mean", lambda: (torch.tensor(2.5, dtype=torch.float64),), {}),
    "1k tensor + bool mask": ("mean", lambda: (torch.ones(1000), torch.ones(1000) > 0), {}),
    "2-d float32 + float weights": ("std", lambda: (torch.ones(4, 8), torch.rand(4, 8)), {}),
    "int tensor, number weight": ("sum", lambda: (torch.arange(5),), {"weight": 2.0}),
    "bf16 dist": ("dist", lambda: (torch.ones(3, dtype=torch.bfloat16),), {}),
    "0-d last": ("last", lambda: (torch.tensor(0.1),), {}),
}


@pytest.mark.parametrize(
    "reduce_host_data_with_numpy", [True, False], ids=["host path", "device path"]
)
@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
@pytest.mark.usefixtures("cpu_tensors_by_reference")
def test_a_tensor_log_call_dispatches_no_torch_op(
    call: tuple, reduce_host_data_with_numpy: bool
) -> None:
    """A tensor recorded by reference (a device tensor's record) costs no torch op."""
    method, make, kwargs = call
    t = Tracker()
    t.reduce_host_data_with_numpy = reduce_host_data_with_numpy
    inputs = [make() for _ in range(4)]
    log = getattr(t, method)
    log("x", *inputs[0], **kwargs)  # a name's first call creates its MetricRecords
    with OpCounter() as counter:
        for args in inputs[1:]:
            log("x", *args, **kwargs)
        t.log_shared([("a", "mean"), ("b", method)], *inputs[1], **kwargs)
    assert counter.ops == []
    assert t.compute()  # and the records reduce


@pytest.mark.parametrize(
    "reduce_host_data_with_numpy", [True, False], ids=["host path", "device path"]
)
@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_a_cpu_tensor_log_call_dispatches_one_clone_per_tensor_at_most(
    call: tuple, reduce_host_data_with_numpy: bool
) -> None:
    """A CPU tensor is recorded as a copy: a 0-d one read as a number (no torch op). On
    the host path, any other of a dtype numpy holds is copied from its memory (no torch
    op either); else it is cloned (one ``aten.clone`` per tensor argument, nothing else)."""
    method, make, kwargs = call
    t = Tracker()
    t.reduce_host_data_with_numpy = reduce_host_data_with_numpy
    inputs = [make() for _ in range(4)]
    log = getattr(t, method)
    log("x", *inputs[0], **kwargs)
    with OpCounter() as counter:
        for args in inputs[1:]:
            log("x", *args, **kwargs)
        t.log_shared([("a", "mean"), ("b", method)], *inputs[1], **kwargs)

    def cloned(a: torch.Tensor) -> bool:
        return a.dim() > 0 and (not reduce_host_data_with_numpy or a.dtype == torch.bfloat16)

    clones = sum(cloned(a) for args in inputs[1:] for a in args) + sum(map(cloned, inputs[1]))
    assert counter.ops == (["aten.clone.default"] * clones if clones else [])
    assert t.compute()


def log_step(t: Tracker, calls: int, rng: np.random.Generator) -> None:
    """``calls`` rounds over 8 metrics of every shape class: 0-d, 1-D with a mask, 2-D."""
    for i in range(calls):
        t.mean("loss", torch.tensor(float(i), dtype=torch.float64))
        t.mean("entropy", torch.rand(16), weight=torch.rand(16) > 0.3)
        t.max("len/max", torch.randint(0, 9, (4,)))
        t.min("len/min", torch.randint(0, 9, (4,)))
        t.sum("tokens", torch.ones(2, 3), weight=torch.ones(2, 3) > 0)
        t.std("adv", torch.rand(2, 4))
        t.last("lr", torch.tensor(1e-3 * (i + 1)))
        t.dist("score", torch.rand(3))
    t.mean("python", float(rng.normal()))


@pytest.mark.parametrize(
    "reduce_host_data_with_numpy", [True, False], ids=["host path", "device path"]
)
def test_compute_dispatches_as_many_torch_ops_for_100_calls_as_for_10000(
    reduce_host_data_with_numpy: bool,
):
    rng = np.random.default_rng(0)
    counts = []
    for calls in (100, 10_000):
        t = Tracker()
        t.reduce_host_data_with_numpy = reduce_host_data_with_numpy
        t.record_limit = 10**9  # one fold, at compute()
        log_step(t, calls, rng)
        with OpCounter() as counter:
            out = t.compute()
        assert out["lr"] == pytest.approx(1e-3 * calls)
        counts.append(len(counter.ops))
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("copy_cpu_tensors", [True, False], ids=["copied", "by reference"])
def test_compute_dispatches_as_many_torch_ops_for_100_mixed_calls_as_for_4000(
    copy_cpu_tensors: bool,
):
    """Issue 44's step: 4 metrics in turn (a 1k float32 tensor with a bool mask, a 0-d
    tensor, a python float, an unmasked 1k tensor to a max) on the host path. Their
    records are host arrays and tensors, joined one part at a time (``assemble``'s
    in-place path), which once read each tensor with a torch op: 52 ops at 100 calls,
    2,002 at 4,000."""
    gen = torch.Generator().manual_seed(0)
    counts = []
    for calls in (100, 4000):
        t = Tracker()
        t.copy_cpu_tensors = copy_cpu_tensors
        t.record_limit = 10**9  # one fold, at compute()
        logged: dict[str, list[Any]] = {"masked": [], "scalar": [], "float": [], "max": []}
        for i in range(calls // 4):
            x, mask = torch.randn(1000, generator=gen), torch.rand(1000, generator=gen) > 0.3
            t.mean("masked", x, weight=mask)
            t.mean("scalar", torch.tensor(float(i)))
            t.mean("float", 0.5 * i)
            t.max("max", x)
            logged["masked"].append(x.numpy()[mask.numpy()])
            logged["max"].append(x.numpy())
        with OpCounter() as counter:
            out = t.compute()
        selected = np.concatenate(logged["masked"]).astype(np.float64)
        assert out["masked"] == pytest.approx(selected.mean(), rel=1e-12)
        assert out["max"] == float(np.concatenate(logged["max"]).max())
        assert out["scalar"] == out["float"] * 2 == pytest.approx((calls // 4 - 1) / 2)
        counts.append(len(counter.ops))
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize(
    "reduce_host_data_with_numpy", [True, False], ids=["host path", "device path"]
)
@pytest.mark.parametrize("where", ["value", "weight", "a view's base"])
@pytest.mark.usefixtures("cpu_tensors_by_reference")
def test_a_tensor_changed_in_place_before_compute_raises_naming_it(
    where: str, reduce_host_data_with_numpy: bool
):
    t = Tracker()
    t.reduce_host_data_with_numpy = reduce_host_data_with_numpy
    base = torch.tensor([1.0, 2.0, 3.0, 4.0])
    value, weight = base[:2], torch.tensor([1.0, 1.0])
    t.mean("kept", torch.tensor([5.0]))
    t.mean("changed", value, weight=weight)
    {"value": value, "weight": weight, "a view's base": base}[where].mul_(2)
    with pytest.raises(ModifiedInputError, match=r"in place.*dropped from this step: 'changed'"):
        t.compute()
    assert t.compute() == {"kept": 5.0}  # the rest of the step is intact


@pytest.mark.parametrize(
    "reduce_host_data_with_numpy", [True, False], ids=["host path", "device path"]
)
@pytest.mark.usefixtures("cpu_tensors_by_reference")
def test_a_tensor_that_requires_grad_is_recorded_detached(
    reduce_host_data_with_numpy: bool,
) -> None:
    t = Tracker()
    t.reduce_host_data_with_numpy = reduce_host_data_with_numpy
    x = torch.ones(3, requires_grad=True)
    loss, weight = (x * 2).sum(), x.sum() * 0 + 2
    t.mean("loss", loss)
    t.mean("weighted", loss, weight=weight)
    for name in ("loss", "weighted"):
        recorded = [*t._metric_records[name].values, *t._metric_records[name].weights]
        assert all(r is None or (not r.requires_grad and r.grad_fn is None) for r in recorded)
    (loss + weight).backward()
    assert t.compute() == {"loss": 6.0, "weighted": 6.0}


REFUSED = {  # label -> (a tensor the log call refuses, the message's end)
    "complex": (torch.ones(3, dtype=torch.complex64), "must be real, got complex dtype"),
    "uint16": (torch.ones(3, dtype=torch.uint16), "has unsupported dtype torch.uint16"),
    "float8": (torch.ones(3).to(torch.float8_e4m3fn), "has unsupported dtype torch.float8"),
    "complex meta": (torch.ones(3, dtype=torch.complex64, device="meta"), "must be real"),
    "meta": (torch.ones(3, device="meta"), "must be a dense tensor with data, got a meta"),
    "sparse": (torch.ones(3).to_sparse(), "must be a dense tensor with data, got a torch.sp"),
}


@pytest.mark.parametrize(
    "reduce_host_data_with_numpy", [True, False], ids=["host path", "device path"]
)
@pytest.mark.parametrize("role", ["value", "weight"])
@pytest.mark.parametrize("label", REFUSED)
def test_a_refused_tensor_raises_in_the_call_and_records_nothing(
    label: str, role: str, reduce_host_data_with_numpy: bool
) -> None:
    """Each check of the tensor log call, on both paths, for the value and the weight:
    the error names the metric and the argument, and the metric's records (versions
    included) are as before the call."""
    bad, message = REFUSED[label]
    t = Tracker()
    t.reduce_host_data_with_numpy = reduce_host_data_with_numpy
    t.mean("m", torch.tensor([1.0, 3.0]))
    records = t._metric_records["m"]
    before = (len(records.values), len(records.weights), list(records.versions), records.arrays)
    args = (bad, None) if role == "value" else (torch.ones(3), bad)
    with pytest.raises(TypeError, match=re.escape(f"metric 'm': {role} {message}")):
        t.mean("m", *args)
    assert (
        len(records.values),
        len(records.weights),
        list(records.versions),
        records.arrays,
    ) == before
    assert t.compute() == {"m": 2.0}


@pytest.mark.parametrize(
    "reduce_host_data_with_numpy", [True, False], ids=["host path", "device path"]
)
@pytest.mark.usefixtures("cpu_tensors_by_reference")
def test_a_call_refused_after_its_weight_was_checked_leaves_the_versions_aligned(
    reduce_host_data_with_numpy: bool,
) -> None:
    """A call that fails a later check (``last`` takes one value) records no version
    counter: the calls around it are checked against their own versions at the fold."""
    t = Tracker()
    t.reduce_host_data_with_numpy = reduce_host_data_with_numpy
    weight = torch.ones(2)
    weight.add_(1)  # a version counter of 1, unlike the records around it
    t.last("lr", torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"metric 'lr' \(kind 'last'\) takes one value"):
        t.last("lr", torch.ones(2), weight=weight)
    t.last("lr", torch.tensor(2.0), weight=torch.tensor(True))
    assert t.compute() == {"lr": 2.0}


@pytest.mark.parametrize(
    "reduce_host_data_with_numpy", [True, False], ids=["host path", "device path"]
)
@pytest.mark.usefixtures("cpu_tensors_by_reference")
def test_a_weight_logged_again_is_checked_again_after_any_in_place_change(
    reduce_host_data_with_numpy: bool,
) -> None:
    """One mask for many metrics is checked once (``CheckedWeight``); an in-place change
    between two calls, even one that changes only its shape, is seen by the next call
    (its check runs again) and by the fold (the calls before it are dropped)."""
    t = Tracker()
    t.reduce_host_data_with_numpy = reduce_host_data_with_numpy
    mask = torch.tensor([True, False, True, True])
    t.mean("a", torch.arange(4.0), weight=mask)
    t.sum("b", torch.arange(4.0), weight=mask)
    mask.resize_(3)  # a new shape, in place: the same object with another version
    with pytest.raises(ValueError, match=r"metric 'c': weight shape \(3,\) does not match"):
        t.mean("c", torch.arange(4.0), weight=mask)
    t.mean("d", torch.arange(3.0), weight=mask)
    with pytest.raises(ModifiedInputError, match=r"dropped from this step: 'a', 'b'$"):
        t.compute()
    assert t.compute() == {"d": 1.0}  # the mask's first three elements: (0 + 2) / 2


@pytest.mark.parametrize(
    "reduce_host_data_with_numpy", [True, False], ids=["host path", "device path"]
)
@pytest.mark.usefixtures("cpu_tensors_by_reference")
def test_a_tensor_given_data_of_another_size_by_assignment_is_dropped_naming_it(
    reduce_host_data_with_numpy: bool,
) -> None:
    """``tensor.data = other`` changes a tensor's data and shape but not its version
    counter, so the fold's version check does not see it: a record whose weight no
    longer matches its value's size is dropped at the fold, named, like any tensor
    changed in place, and the rest of the step is folded (the misaligned records raised
    numpy's or torch's error, naming no metric, and the whole step was lost). The next
    call's checks see it (``CheckedWeight`` compares the shape): refused at the call."""
    t = Tracker()
    t.reduce_host_data_with_numpy = reduce_host_data_with_numpy
    t.mean("kept", torch.tensor([5.0, 7.0]), weight=torch.tensor([1.0, 3.0]))
    t.sum("number", 2.0)
    weight = torch.ones(4)
    t.mean("a", torch.arange(4.0), weight=weight)
    weight.data = torch.tensor([1.0, 2.0, 3.0])  # the same version, another shape
    with pytest.raises(ValueError, match=r"'b': weight shape \(3,\) does not match value"):
        t.mean("b", torch.arange(4.0), weight=weight)  # checked as the new shape
    value = torch.arange(3.0)
    t.std("c", value, weight=torch.ones(3))
    value.data = torch.ones(5)
    with pytest.raises(ModifiedInputError, match=r"dropped from this step: ") as raised:
        t.compute()
    assert str(raised.value).endswith("'a', 'c'")
    assert t.compute() == {"kept": 6.5, "number": 2.0}


@pytest.mark.parametrize(
    "reduce_host_data_with_numpy", [True, False], ids=["host path", "device path"]
)
@pytest.mark.usefixtures("cpu_tensors_by_reference")
def test_a_weight_made_to_require_grad_between_calls_is_recorded_detached(
    reduce_host_data_with_numpy: bool,
) -> None:
    """A weight made to require grad between two calls: the later call records it
    detached though its check was kept (``requires_grad_`` leaves the version as it
    was), and the fold, outside autograd, reads the earlier calls' records too (a value
    made to require grad as well)."""
    t = Tracker()
    t.reduce_host_data_with_numpy = reduce_host_data_with_numpy
    weight = torch.tensor([0.5, 1.0])
    t.mean("a", torch.tensor([1.0, 4.0]), weight=weight)
    value = torch.tensor([2.0, 4.0])
    t.sum("c", value)
    weight.requires_grad_(True)
    value.requires_grad_(True)
    t.mean("b", torch.tensor([1.0, 4.0]), weight=weight)
    assert not any(w.requires_grad for w in t._metric_records["b"].weights)
    assert t.compute() == {"a": 3.0, "b": 3.0, "c": 6.0}


@pytest.mark.parametrize("by", [None, "host labels", "tensor labels"])
def test_a_tracker_keeps_no_logged_weight_alive_after_its_step(by: str | None) -> None:
    """A logged mask is let go with the step's records, the tracker's last checked weight
    included (``CheckedWeight``): at the fold (calls with ``by=`` too, which wait for
    it) and at a reset."""
    from rlmetrics._engine.record import CheckedWeight

    labels = {None: None, "host labels": [0, 1, 0], "tensor labels": torch.tensor([0, 1, 0])}
    t = Tracker()
    for end in ("compute", "reset"):
        mask = torch.tensor([True, False, True])
        released = weakref.ref(mask)
        t.mean("m", torch.arange(3.0), weight=mask, by=labels[by])
        t.sum("s", torch.arange(3.0), weight=mask, by=labels[by])
        getattr(t, end)()
        del mask
        gc.collect()
        assert released() is None, end
        assert t._checked_weight.last is CheckedWeight.NOT_CHECKED, end


@pytest.mark.parametrize(
    "reduce_host_data_with_numpy", [True, False], ids=["host path", "device path"]
)
@pytest.mark.usefixtures("cpu_tensors_by_reference")
def test_a_tensor_changed_before_an_early_fold_raises_at_compute_naming_it(
    reduce_host_data_with_numpy: bool,
) -> None:
    """A fold past ``record_limit`` runs inside a later, unrelated log call: that call
    records as usual, and ``compute()`` raises the early folds' errors, every metric
    they dropped named (a second early fold's too), then returns the rest."""
    t = Tracker()
    t.reduce_host_data_with_numpy = reduce_host_data_with_numpy
    t.record_limit = 6
    first, second = torch.ones(3), torch.ones(3)
    t.mean("a", first)
    first.add_(1)
    t.sum("n", torch.ones(3))  # past the bound: the early fold finds "a" changed
    t.mean("b", second)
    second.add_(1)
    t.sum("n", torch.ones(3))  # past it again: "b"
    with pytest.raises(ModifiedInputError, match=r"'a'.* Then: .*'b'") as raised:
        t.compute()
    assert raised.value.calls == {"a": 1, "b": 1}
    assert t.compute() == {"n": 6.0}


@pytest.mark.parametrize(
    "reduce_host_data_with_numpy", [True, False], ids=["host path", "device path"]
)
def test_the_record_folds_past_its_bound_with_the_same_result(
    reduce_host_data_with_numpy: bool,
) -> None:
    """A bound small enough to fold every few calls gives the one-fold result (to
    rounding), for every kind, and keeps the records short."""
    rng = np.random.default_rng(3)
    chunks = [(rng.normal(3, 2, 7), rng.random(7) > 0.2) for _ in range(40)]
    results = []
    for limit in (10**9, 20):
        t = Tracker()
        t.reduce_host_data_with_numpy = reduce_host_data_with_numpy
        t.record_limit = limit
        for i, (x, keep) in enumerate(chunks):
            for kind in KINDS:
                value = torch.from_numpy(x[:1] if kind == "last" else x)
                t.log(
                    kind, value, torch.from_numpy(keep[:1] if kind == "last" else keep), kind=kind
                )
            t.mean("number", float(i))
            assert all(len(records.values) <= limit + 1 for records in t._metric_records.values())
        results.append(t.compute())
    assert results[0] == pytest.approx(results[1], rel=1e-13)
    x = np.concatenate([x for x, _ in chunks])
    keep = np.concatenate([k for _, k in chunks])
    assert results[1]["mean"] == pytest.approx(reference("mean", "m", x, keep)["m"], rel=1e-13)
    last_x, last_keep = chunks[-1]
    assert results[1]["last"] == (last_x[0] if last_keep[0] else results[1]["last"])


def test_records_of_numbers_and_tensors_keep_call_order_for_last() -> None:
    """``last`` reads the latest selected call, whatever mixes of python numbers, host
    arrays and device-path tensors came before it."""
    for reduce_host_data_with_numpy in (True, False):
        t = Tracker()
        t.reduce_host_data_with_numpy = reduce_host_data_with_numpy
        t.last("lr", 1.0)
        t.last("lr", torch.tensor(2.0))
        t.last("lr", 3.0)
        t.last("lr", torch.tensor([4.0]), weight=torch.tensor([False]))  # deselected
        t.last("lr", np.array(5.0), weight=0.0)  # deselected
        assert t.compute() == {"lr": 3.0}


def test_mixed_shapes_and_dtypes_reduce_in_call_order() -> None:
    """Shape classes are concatenated apart and put back in order: a dist of calls of
    every class and dtype, interleaved, equals numpy on the whole batch."""
    rng = np.random.default_rng(1)
    parts = []
    t = Tracker(quantiles=(0.0, 0.25, 0.5, 1.0))
    t.reduce_host_data_with_numpy = False
    for i in range(30):
        shape = [(), (3,), (2, 2), (1, 4)][i % 4]
        x = rng.normal(size=shape)
        dtype = [torch.float64, torch.float32, torch.bfloat16][i % 3]
        tensor = torch.from_numpy(np.asarray(x)).to(dtype)
        parts.append(tensor.double().reshape(-1).numpy())
        t.dist("d", tensor)
        t.last("order", tensor.reshape(-1)[:1])
        last = float(tensor.reshape(-1)[0])
        if i % 5 == 0:
            t.dist("d", float(i))
            parts.append(np.array([float(i)]))
    whole = np.concatenate(parts)
    out = t.compute()
    assert out["d/p50"] == np.quantile(whole, 0.5) and out["d/max"] == whole.max()
    assert out["d/mean"] == pytest.approx(whole.mean(), rel=1e-14)
    assert out["order"] == last


def test_the_device_half_grows_with_the_names_logged_after_it() -> None:
    """A tensor-path metric folded mid-step makes the table's device half; names logged
    after it grow the table past that size. Every read of the device half (a host
    `last` replacing a device value, a metric's state, packing) must still line up."""
    t = Tracker()
    t.reduce_host_data_with_numpy = False
    t.last("lr", torch.tensor(1.0, dtype=torch.float64))
    t.state()  # folds: the device half exists from here on, sized for one metric
    t.reduce_host_data_with_numpy = True
    for i in range(40):  # past the table's first capacity
        t.mean(f"host/{i:02d}", float(i))
    t.last("lr", 3.0)  # a host value replaces the device one
    state = t.state()
    out = t.compute()
    assert out["lr"] == 3.0 and state.metrics["lr"].maxes == (3.0, -3.0)
    assert [out[f"host/{i:02d}"] for i in range(40)] == [float(i) for i in range(40)]


SEQUENCE_KINDS = {
    "mean": np.mean, "sum": np.sum, "max": np.max, "min": np.min,
    "last": lambda v: v[-1], "std": np.std,
}  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_step_sequences_match_numpy(seed: int) -> None:
    """Steps of random calls (names that come and go, past the pool's compaction; python
    numbers, host arrays, CPU tensors on the host and the tensor path; mid-step folds;
    a tracker pickled or rebuilt from its state mid-run) report numpy's values on each
    step's data: the table's rows, halves and renumbering stay consistent."""
    rng = random.Random(seed)
    t = Tracker()
    t.record_limit = rng.choice([5, 50, 1 << 22])
    for step in range(rng.randint(1, 4)):
        data: dict[str, tuple[str, list[float]]] = {}
        size = rng.choice([3, 30, 300])
        for _ in range(rng.randint(1, 2) * size):
            name = f"m{rng.randrange(size) + (step * 1000 if rng.random() < 0.3 else 0)}"
            kind = data[name][0] if name in data else rng.choice(list(SEQUENCE_KINDS))
            x = rng.uniform(-5.0, 5.0)
            path = rng.choice(["float", "array", "tensor", "tensor path"])
            t.reduce_host_data_with_numpy = path != "tensor path"
            value: Any = x
            if path == "array":
                value = np.array([x])
            elif path.startswith("tensor"):
                value = torch.tensor(x, dtype=torch.float64)
            try:
                getattr(t, kind)(name, value)
            except ValueError:  # the name is another kind in the pool: not logged
                continue
            data.setdefault(name, (kind, []))[1].append(x)
        if rng.random() < 0.2:
            t = pickle.loads(pickle.dumps(t))
        elif rng.random() < 0.2:
            rebuilt = Tracker()
            rebuilt.merge(t.state())
            t = rebuilt
        got = t.compute(sync=False)
        want = {name: SEQUENCE_KINDS[kind](np.array(v)) for name, (kind, v) in data.items()}
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert got[name] == pytest.approx(value, rel=1e-12, abs=1e-12), name


def test_steps_that_log_the_same_numbers_in_another_order_fold_each_order() -> None:
    """The flat numbers' layout is kept from one step to the next only while the calls
    come in the same order: steps that reorder the same calls (same count, same metrics)
    or change their count report numpy's values on each step's data. Each step's first
    calls name the metrics in the same order, so only the later calls' order changes."""
    rng = random.Random(7)
    t = Tracker()
    names = [(f"m{i}", kind) for i, kind in enumerate(["mean", "last", "max", "std"] * 3)]
    for step in range(12):
        calls = [(name, kind, rng.uniform(-3, 3)) for name, kind in names for _ in range(3)]
        first, rest = calls[::3], [call for i, call in enumerate(calls) if i % 3]
        if step % 3:
            rng.shuffle(rest)
        if step % 4 == 3:
            rest = rest[:-2]
        calls = first + rest
        data: dict[str, tuple[str, list[float]]] = {}
        for name, kind, x in calls:
            getattr(t, kind)(name, x)
            data.setdefault(name, (kind, []))[1].append(x)
        got = t.compute(sync=False)
        for name, (kind, values) in data.items():
            want = SEQUENCE_KINDS[kind](np.array(values))
            assert got[name] == pytest.approx(want, rel=1e-12, abs=1e-12), (step, name)


class _Float(float):
    """A float subclass (as a framework's number type may be)."""


NUMBERS = {  # label -> a number type's 2.5 (or 2 / True), as a log call may receive it
    "float subclass": _Float(2.5),
    "np.float16": np.float16(2.5),
    "np.float64": np.float64(2.5),
    "np.int64": np.int64(2),
    "np.bool_": np.bool_(True),
    "bool": True,
    "0-d array": np.array(2.5),
    "0-d int array": np.array(2, dtype=np.int32),
    "fraction": __import__("fractions").Fraction(5, 2),
}


@pytest.mark.parametrize(
    "reduce_host_data_with_numpy", [True, False], ids=["host path", "device path"]
)
@pytest.mark.parametrize("label", NUMBERS)
def test_every_number_type_logs_as_its_float(label: str, reduce_host_data_with_numpy: bool) -> None:
    """A number of any real type, as a value or a weight (with a number, an array or a
    tensor as the other), logs as ``float(number)`` does."""
    number = NUMBERS[label]
    got, expected = Tracker(), Tracker()
    got.reduce_host_data_with_numpy = expected.reduce_host_data_with_numpy = (
        reduce_host_data_with_numpy
    )
    for t, x in ((got, number), (expected, float(number))):
        t.mean("value", x)
        t.mean("value, number weight", x, weight=3.0)
        t.mean("weight, number value", 4.0, weight=x)
        t.sum("weight, array value", np.array([1.0, 2.0]), weight=x)
        t.sum("weight, tensor value", torch.tensor([1.0, 2.0]), weight=x)
        t.max("value, tensor weight", x, weight=torch.tensor(True))
    assert got.compute() == expected.compute()


@pytest.mark.parametrize(
    "reduce_host_data_with_numpy", [True, False], ids=["host path", "device path"]
)
@pytest.mark.parametrize("by", [None, np.array([0, 1, 1, 0])], ids=["plain", "by labels"])
def test_host_arrays_are_copied_whatever_their_dtype(
    by: Any, reduce_host_data_with_numpy: bool
) -> None:
    """Bool and float64 arrays (recorded as plain copies), int and float32 arrays and
    lists (converted), as values and weights, change nothing when the caller reuses them,
    and log as their float64 values do."""
    inputs = {
        "bool": np.array([True, False, True, True]),
        "float64": np.array([0.5, 1.5, 2.5, 3.5]),
        "strided float64": np.arange(8.0)[::2],
        "int": np.array([1, 0, 2, 5]),
        "float32": np.array([0.25, 1.0, 2.0, 4.0], dtype=np.float32),
        "list": [1.0, 0.0, 3.0, 2.0],
    }
    mask = np.array([True, True, False, True])
    got, expected = Tracker(), Tracker()
    got.reduce_host_data_with_numpy = expected.reduce_host_data_with_numpy = (
        reduce_host_data_with_numpy
    )
    for label, x in inputs.items():
        as_float = np.asarray(x, dtype=np.float64).copy()
        for t, value, weight in ((got, x, mask), (expected, as_float, mask * 1.0)):
            t.mean(f"{label}/value", value, weight=weight, by=by)
            t.sum(f"{label}/weight", np.ones(4), weight=value, by=by)
        for array in (x, mask):
            if isinstance(array, np.ndarray):
                array[...] = array[::-1].copy()  # reused by the caller before the step ends
            else:
                array.reverse()
        mask = np.array([True, True, False, True])
    assert got.compute() == expected.compute()


def _records(records: Any) -> tuple:
    """What a log call left in a MetricRecords, comparable with ==."""

    def same(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return (x.dtype, x.shape, x.tolist(), x.requires_grad)
        if isinstance(x, np.ndarray):  # a host copy
            return (x.dtype, x.shape, x.tolist())
        return type(x), x

    def host_scalar(value: Any, weight: Any) -> tuple:
        """A copied 0-d tensor: a python float (the fast path, with a python weight) or
        a 0-d float64 array (``prepare``, its weight None for 1, a number or a 0-d
        array) record the same call."""
        if host_0d(value) and (weight is None or host_0d(weight)):
            return (np.float64, float(value)), (np.float64, 1.0 if weight is None else weight)
        return same(value), same(weight)

    def host_0d(x: Any) -> bool:
        return type(x) is float or (isinstance(x, np.ndarray) and x.ndim == 0)

    pairs = [host_scalar(v, w) for v, w in zip(records.values, records.weights, strict=True)]
    return (
        [v for v, _ in pairs],
        [w for _, w in pairs],
        list(records.versions),
        records.arrays,
        records.num_deferred_checks,
        records.accepted_a_call,
        records.record_device,
    )


def _outcome(record: Any, kind: str) -> tuple:
    from rlmetrics._engine.record import MetricRecords
    from rlmetrics._engine.table import StateTable
    from rlmetrics.kinds import get_kind

    table = StateTable()
    records = MetricRecords(get_kind(kind), table, table.add_row(get_kind(kind)), "m")
    try:
        size = record(records)
    except (TypeError, ValueError) as error:
        return type(error), str(error), _records(records)
    return size, _records(records)


TENSOR_VALUES = {
    "0-d": lambda: torch.tensor(2.5),
    "1-d": lambda: torch.arange(4.0),
    "bf16 2-d": lambda: torch.ones(2, 2, dtype=torch.bfloat16),
    "requires grad": lambda: torch.arange(4.0, requires_grad=True) * 1,
    "int": lambda: torch.arange(4),
    "bumped version": lambda: torch.arange(4.0).add_(1),
}
WEIGHTS = {
    "none": lambda v: None,
    "bool mask": lambda v: torch.ones(v.shape, dtype=torch.bool),
    "float tensor": lambda v: torch.full(v.shape, 0.5),
    "requires grad tensor": lambda v: torch.full(v.shape, 0.5, requires_grad=True) * 1,
    "wrong shape": lambda v: torch.ones(7),
    "meta": lambda v: torch.ones(v.shape, device="meta"),
    "complex": lambda v: torch.ones(v.shape, dtype=torch.complex64),
    "float": lambda v: 2.0,
    "int": lambda v: 3,
    "zero": lambda v: 0.0,
    "negative": lambda v: -1.0,
    "nan": lambda v: float("nan"),
    "inf": lambda v: float("inf"),
    "huge int": lambda v: 10**400,
}


def test_python_numbers_with_and_without_weights_fold_each_weight_in_place() -> None:
    """A python-number call records its weight only when it is not 1; interleaved
    weighted and plain calls of many metrics, in changing orders and with a mid-step
    fold, report numpy's weighted means and sums on each step's data."""
    rng = random.Random(5)
    t = Tracker()
    for step in range(6):
        data: dict[str, list[tuple[float, float]]] = {}
        calls = [(f"m{i % 7}", rng.uniform(-2, 2), rng.choice([1.0, 1.0, 0.5, 3.0, 1e-3]))
                 for i in range(60)]  # fmt: skip
        if step % 2:
            rng.shuffle(calls)
        for i, (name, x, w) in enumerate(calls):
            if w == 1.0 and rng.random() < 0.5:
                t.mean(name, x)  # no weight given
            else:
                t.mean(name, x, weight=w)
            t.sum(f"s/{name}", x, weight=w)
            data.setdefault(name, []).append((x, w))
            if step == 3 and i == 30:
                t._fold()
        got = t.compute()
        for name, pairs in data.items():
            x, w = np.array(pairs).T
            assert got[name] == pytest.approx((x * w).sum() / w.sum(), rel=1e-12), (step, name)
            assert got[f"s/{name}"] == pytest.approx((x * w).sum(), rel=1e-12, abs=1e-12)


def _later_max(a: float, b: float) -> float:
    """max as a fold in call order: NaN wins, and of two equal values (0.0 and -0.0)
    the later one."""
    if a != a:
        return a
    return b if b != b or b >= a else a


@pytest.mark.parametrize("calls", [1, 2, 3, 4])
def test_max_and_min_of_signed_zeros_keep_the_later_of_equal_values(calls: int) -> None:
    """Python numbers, up to 4 calls per metric, in steps where every metric has as many
    calls and steps where one has one fewer: max and min report the fold in call order,
    bit for bit (which of 0.0 and -0.0, which infinity)."""
    rng = random.Random(calls)
    t = Tracker()
    pool = [0.0, -0.0, 1.0, -1.0, math.inf, -math.inf]
    for step in range(8):
        data: dict[str, list[float]] = {}
        for call in range(calls):
            for i in range(80):  # many rows, several columns stacked
                if step % 2 and i == 5 and call == calls - 1 and calls > 1:
                    continue  # one metric short: rows of unequal length
                x = rng.choice(pool)
                t.max(f"max/{i}", x)
                t.min(f"min/{i}", x)
                data.setdefault(str(i), []).append(x)
        got = t.compute()
        for i, values in data.items():
            high = functools.reduce(_later_max, values)
            low = -functools.reduce(_later_max, [-x for x in values])
            assert got[f"max/{i}"].hex() == high.hex(), (step, values)
            assert got[f"min/{i}"].hex() == low.hex(), (step, values)


@pytest.mark.parametrize(
    "reduce_host_data_with_numpy", [True, False], ids=["host path", "tensor path"]
)
def test_tensors_of_several_dtypes_in_one_step_fold_exactly(
    reduce_host_data_with_numpy: bool,
) -> None:
    """Tensors of one shape but other dtypes, folded together: each converts to float64
    on its own (an int64 beyond float32's precision beside float32 tensors stays exact)."""
    t = Tracker()
    t.reduce_host_data_with_numpy = reduce_host_data_with_numpy
    big = torch.tensor([2**40 + 1, 3], dtype=torch.int64)
    small = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float32)
    half = torch.tensor([0.5, 1.5], dtype=torch.bfloat16)
    t.sum("count", big)
    t.mean("x", small)
    t.sum("count", torch.tensor(7, dtype=torch.int64))
    t.mean("x", half)
    t.mean("x", torch.tensor(0.25, dtype=torch.float32))
    got = t.compute()
    assert got["count"] == 2**40 + 11
    expected = np.concatenate([small.double().numpy(), half.double().numpy(), [0.25]])
    assert got["x"] == pytest.approx(reference("mean", "x", expected, None)["x"], rel=1e-12)


@pytest.mark.parametrize(
    "reduce_host_data_with_numpy", [True, False], ids=["host path", "tensor path"]
)
def test_a_large_step_matches_numpy_whatever_its_records(reduce_host_data_with_numpy: bool) -> None:
    """A step past the small-batch size (sums by segment): masked float32 tensors with
    NaN and inf under the mask, 0-d tensors, python numbers and every kind stated by its
    columns, split into micro-batches in two ways, report
    numpy's values on the whole batch (exact for max, min and counts)."""
    rng = np.random.default_rng(5)
    n = 9000  # per metric: two metrics pass host_batch.SMALL together
    x = rng.normal(3.0, 2.0, size=(2, n)).astype(np.float32)
    keep = rng.random((2, n)) > 0.3
    x[~keep & (rng.random((2, n)) < 0.05)] = np.nan  # unselected: change nothing
    x[~keep & (rng.random((2, n)) < 0.05)] = -np.inf
    floats = rng.normal(size=8)
    results = []
    for cuts in ([n], [1000, 4500, 4501, n]):
        t = Tracker()
        t.reduce_host_data_with_numpy = reduce_host_data_with_numpy
        start = 0
        for stop in cuts:
            part = slice(start, stop)
            for kind, row in (("mean", 0), ("sum", 1), ("max", 0), ("min", 1)):
                t.log(f"{kind}/x", torch.from_numpy(x[row, part]),
                      torch.from_numpy(keep[row, part]), kind=kind)  # fmt: skip
            t.mean("loss", torch.tensor(float(floats[start % 8]), dtype=torch.float32))
            t.max("number", float(floats[stop % 8]))
            start = stop
        results.append(t.compute())
    want = {
        "mean/x": reference("mean", "m", x[0].astype(np.float64), keep[0])["m"],
        "sum/x": reference("sum", "m", x[1].astype(np.float64), keep[1])["m"],
    }
    for got in results:
        assert got["mean/x"] == pytest.approx(want["mean/x"], rel=1e-12)
        assert got["sum/x"] == pytest.approx(want["sum/x"], rel=1e-12)
        assert got["max/x"] == x[0][keep[0]].max() and got["min/x"] == x[1][keep[1]].min()
    assert results[0]["number"] == floats[n % 8]
    assert results[1]["number"] == max(floats[[1000 % 8, 4500 % 8, 4501 % 8, n % 8]])


DEVICE_CHANGES = {  # label -> (a change to the logged value x, whether the fold sees it)
    "in place": (lambda x: x.add_(1), True),
    "indexed assignment": (lambda x: x.__setitem__(0, 5.0), True),
    "through a view": (lambda x: x[:2].mul_(3), True),
    "through detach()": (lambda x: x.detach().mul_(3), True),
    "resize_": (lambda x: x.resize_(2, 2), True),
    "out=": (lambda x: torch.add(x, 1, out=x), True),
    "through .data": (lambda x: x.data.mul_(3), False),
    ".data = same size": (lambda x: setattr(x, "data", x.data * 3), False),
    "through DLPack": (lambda x: from_dlpack(to_dlpack(x)).mul_(3), False),
}


@pytest.mark.usefixtures("cpu_tensors_by_reference")
@pytest.mark.parametrize("change", DEVICE_CHANGES)
def test_a_device_tensor_record_sees_the_changes_its_version_counter_counts(change: str) -> None:
    """A device tensor is recorded by reference (a copy would cost a device operation per
    call), so what the fold finds is what torch's version counter counts, as
    docs/concepts.md lists: an in-place operation on the tensor or on any view or
    ``detach()`` alias of it (they share its counter) raises ``ModifiedInputError``
    naming the metric; a write through ``tensor.data`` or through memory shared outside
    torch (DLPack) moves no counter, and the fold reads the changed values. Run on the
    CPU through the device path, CPU tensors kept by reference as device tensors are."""
    t = Tracker()
    t.reduce_host_data_with_numpy = False
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    t.sum("x", x)
    t.sum("kept", torch.tensor([5.0]))
    apply, seen = DEVICE_CHANGES[change]
    apply(x)
    if seen:
        with pytest.raises(ModifiedInputError, match=r"dropped from this step: 'x'$"):
            t.compute()
        assert t.compute() == {"kept": 5.0}
    else:
        now = float(x.double().sum())
        assert now != 10.0  # the values at the call summed to 10
        assert t.compute() == {"x": now, "kept": 5.0}


@pytest.mark.parametrize("copy", [True, False], ids=["copied", "by reference"])
def test_only_tensors_recorded_by_reference_keep_a_version_to_check(copy: bool) -> None:
    """A CPU tensor the log call copied is held by nothing else, so the fold checks no
    version of it (a read per tensor per fold saved); one recorded by reference keeps
    itself and its version, and a change to it is caught at the fold."""
    t = Tracker()
    t.copy_cpu_tensors = copy
    value, mask = torch.arange(4.0), torch.tensor([True, False, True, True])
    t.mean("m", value, weight=mask)
    t.mean("m", torch.ones(2))
    versions = t._metric_records["m"].versions
    if copy:
        assert versions == []
        value.add_(1.0)  # the copies keep the values at the call
        assert t.compute() == {"m": (0.0 + 2.0 + 3.0 + 2.0) / 5}
    else:
        assert versions[1::2] == [0, 0, 0]  # weight, value, the second value
        assert versions[0] is mask and versions[2] is value
        value.add_(1.0)
        with pytest.raises(ModifiedInputError, match="'m'"):
            t.compute()
