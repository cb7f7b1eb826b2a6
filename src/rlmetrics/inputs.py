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
NUMPY_DTYPES = frozenset(
    {torch.float64, torch.float32, torch.float16, torch.bool, torch.uint8, torch.int8}
    | {torch.int16, torch.int32, torch.int64}
)
"""Tensor dtypes whose CPU data numpy can view directly."""


def check_name(name: object) -> str:
    """A metric name must be a non-empty string."""
    if not isinstance(name, str):
        raise TypeError(f"metric names must be strings, got {type(name).__name__} {name!r}")
    if not name:
        raise ValueError("metric names must not be empty")
    return name


def as_number(name: str, value: object, what: str = "value") -> float | None:
    """``value`` as a python float when it is a real number (a 0-d numpy array of one
    included), else None."""
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "biuf":
        return float(value)
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
        _check_tensor(name, value, what)
        tensor = value.detach()
        return tensor if tensor.dtype is torch.float64 else tensor.to(torch.float64)
    return torch.from_numpy(numeric_array(name, value, what))


def numeric_array(name: str, value: object, what: str = "value") -> np.ndarray:
    """``value`` (numpy array, list, tuple) as a contiguous float64 numpy array."""
    if not isinstance(value, np.ndarray | list | tuple):
        raise TypeError(
            f"metric {name!r}: {what} must be a number, numpy array or tensor, "
            f"got {type(value).__name__}"
        )
    try:
        array = np.asarray(value)
    except ValueError as error:  # numpy's message does not say which metric
        raise ValueError(
            f"metric {name!r}: {what} is a ragged sequence (rows of different lengths, "
            f"or numbers mixed with sequences); pass equal-length rows or a flat list ({error})"
        ) from error
    if array.dtype.kind not in "biuf":
        raise TypeError(
            f"metric {name!r}: {what} must be numeric, got an array of dtype {array.dtype}"
            if array.dtype.kind != "c"
            else f"metric {name!r}: {what} must be real, got complex dtype {array.dtype}"
        )
    array = np.ascontiguousarray(array, dtype=np.float64)
    return array if array.flags.writeable else array.copy()


def unmask(name: str, value: object, weight: object) -> tuple[object, object]:
    """A numpy masked array's data, and a weight that is 0 where it is masked (masked
    elements contribute nothing); a masked weight is 0 where masked. Other inputs pass
    through unchanged."""
    if isinstance(weight, np.ma.MaskedArray):
        weight = np.ma.filled(weight, 0)
    if not isinstance(value, np.ma.MaskedArray):
        return value, weight
    masked = np.ma.getmaskarray(value)
    data = np.ma.getdata(value)
    if not masked.any():
        return data, weight
    if weight is None:
        return data, ~masked
    if not in_host_memory(weight):
        raise TypeError(
            f"metric {name!r}: a numpy masked array's weight must be in host memory, got a "
            f"tensor on {weight.device}"  # type: ignore[union-attr]
        )
    number = None if isinstance(weight, Tensor) else as_number(name, weight, "weight")
    if number is not None:
        check_weight_number(name, number)
        return data, np.where(masked, 0.0, number)
    weights = host_array(name, weight, "weight")
    _check_shapes(name, weights.shape, data.shape)
    return data, np.where(masked, 0.0, weights)


def in_host_memory(value: object) -> bool:
    """Whether ``value`` is not a tensor or is a plain CPU tensor (subclasses, like device
    tensors, keep the tensor path)."""
    return not isinstance(value, Tensor) or (type(value) is Tensor and value.device.type == "cpu")


def host_array(name: str, value: object, what: str = "value") -> np.ndarray:
    """``value`` (numpy array, list, tuple or CPU tensor: see ``in_host_memory``) as a
    float64 numpy array; a float64 CPU tensor is viewed, not copied."""
    if not isinstance(value, Tensor):
        return numeric_array(name, value, what)
    _check_tensor(name, value, what)
    tensor = value.detach() if value.requires_grad else value
    if tensor.dtype not in NUMPY_DTYPES:  # bfloat16 and friends have no numpy twin
        tensor = tensor.to(torch.float64)
    elif tensor.is_neg():
        tensor = tensor.resolve_neg()
    return tensor.numpy().astype(np.float64, copy=False)


def host_weights(name: str, weight: object, values: np.ndarray) -> np.ndarray | None:
    """``weight`` (number, bool mask, array, CPU tensor) matching ``values`` as a float64
    array, or None when there is no weight."""
    if weight is None:
        return None
    number = None if isinstance(weight, Tensor) else as_number(name, weight, "weight")
    if number is not None:
        check_weight_number(name, number)
        return np.full_like(values, number)
    weights = host_array(name, weight, "weight")
    _check_shapes(name, weights.shape, values.shape)
    return weights


def _check_tensor(name: str, tensor: Tensor, what: str) -> None:
    """A tensor must be real, dense (strided), not nested and hold data (not meta)."""
    if tensor.is_complex():
        raise TypeError(f"metric {name!r}: {what} must be real, got complex dtype {tensor.dtype}")
    if tensor.layout is not torch.strided or tensor.is_nested or tensor.is_meta:
        if tensor.is_nested:
            problem = "a nested tensor; pass its flat values (for example torch.cat(t.unbind()))"
        elif tensor.is_meta:
            problem = "a meta tensor, which holds no data"
        else:
            problem = f"a {tensor.layout} tensor; pass a dense one (tensor.to_dense())"
        raise TypeError(f"metric {name!r}: {what} must be a dense tensor with data, got {problem}")


def _check_shapes(name: str, weight_shape: tuple[int, ...], value_shape: tuple[int, ...]) -> None:
    if weight_shape != value_shape:
        raise ValueError(
            f"metric {name!r}: weight shape {tuple(weight_shape)} does not match "
            f"value shape {tuple(value_shape)}"
        )


def as_weights(name: str, weight: object, values: Tensor) -> Tensor | None:
    """A weight (number, bool mask, array, tensor) matching ``values``, as float64."""
    if weight is None:
        return None
    number = as_number(name, weight, "weight")
    if number is not None:
        check_weight_number(name, number)
        return torch.full_like(values, number)
    weights = as_tensor(name, weight, "weight")
    _check_shapes(name, weights.shape, values.shape)
    return weights if weights.device == values.device else weights.to(values.device)


def check_weight_number(name: str, weight: float) -> None:
    """A python weight must be finite and non-negative."""
    if not weight >= 0 or math.isinf(weight):
        raise ValueError(f"metric {name!r}: weights must be finite and >= 0, got {weight!r}")
