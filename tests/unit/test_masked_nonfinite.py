"""An element with weight 0 contributes nothing, whatever its value: NaN and ±inf at
masked-out positions (padding often holds them) leave every kind's result, under every
``nonfinite`` policy, equal to numpy's on the unmasked elements; they are neither
counted (``skip``) nor rejected (``error``). Host arrays, the tensor path (the
``log_path`` fixture runs both) and python numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlmetrics import Tracker

from helpers import reference

NAN, INF = math.nan, math.inf
pytestmark = pytest.mark.usefixtures("log_path")  # host and tensor paths
POLICIES = ("propagate", "skip", "error")
KINDS = ("mean", "std", "sum", "max", "min", "dist")
VALUES = np.array([0.5, NAN, 2.0, INF, -1.25, -INF, 3.0, NAN])
WEIGHTS = np.array([1.0, 0.0, 2.0, 0.0, 0.5, 0.0, 3.0, 0.0])


def assert_numpy_on_unmasked(out: dict, kind: str, weights: np.ndarray) -> None:
    """``out`` is numpy's answer on the elements with weight > 0 (all finite): no NaN,
    no non-finite count."""
    kept = weights > 0
    expected = reference(kind, "m", VALUES[kept], weights[kept])
    assert out.keys() == expected.keys()
    for key, value in expected.items():
        assert math.isfinite(out[key]), key
        assert out[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("weight_form", ["weights", "bool mask", "float mask"])
@pytest.mark.parametrize("value_form", ["tensor", "tensor 2-d", "numpy", "list", "python"])
def test_masked_nonfinite_values_change_nothing(
    kind: str, policy: str, weight_form: str, value_form: str
) -> None:
    weights = WEIGHTS if weight_form == "weights" else (WEIGHTS > 0).astype(np.float64)
    weight_input = WEIGHTS > 0 if weight_form == "bool mask" else weights
    t = Tracker(nonfinite=policy)
    if value_form == "python":
        for value, weight in zip(VALUES.tolist(), np.asarray(weight_input).tolist(), strict=True):
            t.log("m", value, weight, kind=kind)
    elif value_form == "numpy":
        t.log("m", VALUES.copy(), np.array(weight_input), kind=kind)
    elif value_form == "list":
        t.log("m", VALUES.tolist(), np.asarray(weight_input).tolist(), kind=kind)
    else:
        shape = (2, 4) if value_form == "tensor 2-d" else (8,)
        t.log(
            "m",
            torch.tensor(VALUES).reshape(shape),
            torch.tensor(weight_input).reshape(shape),
            kind=kind,
        )
    assert_numpy_on_unmasked(t.compute(), kind, weights)  # "error" raises nothing


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", ["mean", "std"])
def test_the_issues_python_example(kind: str, policy: str) -> None:
    """``t.mean("y", float("nan"), weight=0)``: nothing at all, next to real values."""
    t = Tracker(nonfinite=policy)
    t.log("y", 2.0, kind=kind)
    t.log("y", float("nan"), weight=0, kind=kind)
    t.log("y", -INF, 0.0, kind=kind)
    t.log("y", 4.0, kind=kind)
    t.log("alone", float("nan"), weight=0, kind=kind)  # an empty metric, not a NaN one
    assert t.compute() == reference(kind, "y", np.array([2.0, 4.0]), None)


@pytest.mark.parametrize("kind", ["mean", "std"])
def test_unmasked_nonfinite_values_still_follow_the_policy(kind: str) -> None:
    """Only the masked ones are exempt: an unmasked NaN is counted, rejected or spread."""
    values = torch.tensor([1.0, NAN, INF, 3.0])
    weights = torch.tensor([1.0, 1.0, 0.0, 1.0])
    skip = Tracker(nonfinite="skip")
    skip.log("m", values, weights, kind=kind)
    expected = reference(kind, "m", np.array([1.0, 3.0]), None)
    assert skip.compute() == pytest.approx({**expected, "m/nonfinite_count": 1.0}, rel=1e-12)
    propagate = Tracker()
    propagate.log("m", values, weights, kind=kind)
    assert math.isnan(propagate.compute()["m"])
    error = Tracker(nonfinite="error")
    error.log("m", values, weights, kind=kind)
    with pytest.raises(ValueError, match=rf"'m' \({kind}\): 1"):
        error.compute()


@pytest.mark.parametrize("policy", POLICIES)
def test_last_with_a_zero_weight_keeps_the_previous_value(policy: str) -> None:
    """``last`` takes a weight as a selector: weight 0 (a masked NaN too) changes nothing."""
    t = Tracker(nonfinite=policy)
    t.last("lr", 0.5)
    t.last("lr", NAN, weight=0.0)
    t.last("lr", torch.tensor([INF]), weight=torch.tensor([False]))
    t.last("lr", np.array([NAN]), weight=np.array([0.0]))
    assert t.compute() == {"lr": 0.5}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("masked_nonfinite", "selected_inf"),
    [(False, False), (True, False), (True, True)],
    ids=["finite", "masked only", "a selected inf"],
)
def test_large_float32_masked_steps_equal_numpy(
    kind: str, policy: str, masked_nonfinite: bool, selected_inf: bool
) -> None:
    """Large steps of float32 tensors with bool masks (summed by segment, their selected
    values times the mask in one pass where every product is finite): NaN and ±inf at
    masked-out positions of two metrics change nothing; a selected infinity still
    follows the policy."""
    gen = np.random.default_rng(7)
    calls = {name: [] for name in ("a", "b")}
    t = Tracker(nonfinite=policy)
    for i in range(24):
        name = "ab"[i % 2]
        values = gen.standard_normal(1500).astype(np.float32)
        mask = gen.random(1500) > 0.3
        if masked_nonfinite:
            values[np.flatnonzero(~mask)[:3]] = [NAN, INF, -INF]
        if selected_inf and i == 5:
            values[np.flatnonzero(mask)[0]] = INF
        calls[name].append((values, mask))
        t.log(name, torch.from_numpy(values.copy()), torch.from_numpy(mask), kind=kind)
    expected: dict = {}
    for name, logged in calls.items():
        if policy == "error" and selected_inf and name == "b":
            del logged[2]  # the call with the infinity is rejected, all of it
        values = np.concatenate([v[m] for v, m in logged]).astype(np.float64)
        if policy == "skip" and selected_inf and name == "b":
            values = values[np.isfinite(values)]  # the infinity is dropped and counted
            expected[f"{name}/nonfinite_count"] = 1.0
        with np.errstate(invalid="ignore"):
            expected.update(reference(kind, name, values, None))
    if policy == "error" and selected_inf:
        with pytest.raises(ValueError, match=rf"'b' \({kind}\): 1"):
            t.compute()
    out = t.compute()
    assert out.keys() == expected.keys()
    for key, value in expected.items():
        if math.isnan(value):
            assert math.isnan(out[key]), key
        else:
            assert out[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
