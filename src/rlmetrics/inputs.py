"""Turning what users log (numbers, arrays, tensors) into float64 values and weights.

Checks here look at types, shapes and dtypes only: never at tensor data, which would
need a device-to-host sync. Data checks on tensors (negative weights, non-finite values
under ``nonfinite="error"``) run on the device and are reported at step end.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch
from torch import Tensor

NUMBER_TYPES = (float, int, bool, np.floating, np.integer, np.bool_)


def check_name(name: object) -> str:
    """A metric name must be a non-empty string."""
    if not isinstance(name, str):
        raise TypeError(f"metric names must be strings, got {type(name).__name__} {name!r}")
    if not name:
        raise ValueError("metric names must not be empty")
    return name


def as_number(name: str, value: object, what: str = "value") -> float | None:
    """``value`` as a python float when it is a real number, else None."""
    if isinstance(value, (*NUMBER_TYPES, numbers.Real)):
        try:
            return float(value)
        except OverflowError as error:  # a python int beyond float64's range
            raise ValueError(
                f"metric {name!r}: {what} is out of float64's range ({error})"
            ) from error
    if isinstance(value, complex | np.complexfloating):
        raise TypeError(f"metric {name!r}: {what} must be real, got complex {value!r}")
    return None


def as_tensor(name: str, value: object, what: str = "value") -> Tensor:
    """``value`` (array, tensor, sequence) as a detached float64 tensor, same device."""
    if isinstance(value, Tensor):
        tensor = value.detach()
    elif isinstance(value, np.ndarray | list | tuple):
        array = np.asarray(value)
        if array.dtype.kind not in "biuf":
            raise TypeError(
                f"metric {name!r}: {what} must be numeric, got an array of dtype {array.dtype}"
                if array.dtype.kind != "c"
                else f"metric {name!r}: {what} must be real, got complex dtype {array.dtype}"
            )
        tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float64))
    else:
        raise TypeError(
            f"metric {name!r}: {what} must be a number, numpy array or tensor, "
            f"got {type(value).__name__}"
        )
    if tensor.is_complex():
        raise TypeError(f"metric {name!r}: {what} must be real, got complex dtype {tensor.dtype}")
    return tensor if tensor.dtype is torch.float64 else tensor.to(torch.float64)


def as_weights(name: str, weight: object, values: Tensor) -> Tensor | None:
    """A weight (number, bool mask, array, tensor) matching ``values``, as float64."""
    if weight is None:
        return None
    number = as_number(name, weight, "weight")
    if number is not None:
        check_weight_number(name, number)
        return torch.full_like(values, number)
    weights = as_tensor(name, weight, "weight")
    if weights.shape != values.shape:
        raise ValueError(
            f"metric {name!r}: weight shape {tuple(weights.shape)} does not match "
            f"value shape {tuple(values.shape)}"
        )
    return weights if weights.device == values.device else weights.to(values.device)


def check_weight_number(name: str, weight: float) -> None:
    """A python weight must be finite and non-negative."""
    if not weight >= 0 or math.isinf(weight):
        raise ValueError(f"metric {name!r}: weights must be finite and >= 0, got {weight!r}")
