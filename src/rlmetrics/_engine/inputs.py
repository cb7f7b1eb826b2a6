"""Checking what users log (numbers, arrays, tensors): python floats, host copies, tensors.

Checks here look at types, shapes and dtypes only: never at tensor data, which would
need a device-to-host sync. Data checks (negative weights, non-finite values under
``nonfinite="error"``) run when the step's records are reduced (``rlmetrics._engine.fold``).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import torch
from torch import Tensor

NUMBER_TYPES = (float, int, bool, np.floating, np.integer, np.bool_)
REAL_DTYPES = frozenset(
    {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.uint8}
    | {torch.int8, torch.int16, torch.int32, torch.int64}
)
"""Tensor dtypes a log call takes (float8 and unsigned 16-64-bit ints are left out)."""
_REAL_TYPES = (*NUMBER_TYPES, numbers.Real)
_COMPLEX_TYPES = (complex, np.complexfloating)
_ARRAY_TYPES = (np.ndarray, list, tuple)
_FLOAT64, _BOOL = np.dtype(np.float64), np.dtype(bool)
MaskedArray = np.ma.MaskedArray
STRIDED = torch.strided  # a module global: one lookup instead of two on the log path


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
    if type(value) is float:
        return value
    if isinstance(value, np.ndarray):
        return float(value) if value.ndim == 0 and value.dtype.kind in "biuf" else None
    if isinstance(value, _REAL_TYPES):
        try:
            return float(value)
        except OverflowError as error:  # a python int beyond float64's range
            raise ValueError(
                f"metric {name!r}: {what} is out of float64's range ({error})"
            ) from error
    if isinstance(value, _COMPLEX_TYPES):
        raise TypeError(f"metric {name!r}: {what} must be real, got complex {value!r}")
    return None


def numeric_array(name: str, value: object, what: str = "value") -> np.ndarray:
    """``value`` (numpy array, list, tuple) as a new contiguous numpy array.

    It is a copy: a record must not change when the caller's array does. It is float64,
    or bool for a bool array: a mask copies in an eighth of the bytes, and the fold reads
    it as 0 and 1."""
    if not isinstance(value, _ARRAY_TYPES):
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
    if array.dtype is _FLOAT64 or array.dtype is _BOOL:  # native ones: a plain copy
        return array.copy() if isinstance(value, np.ndarray) else array  # a list's is new
    return np.array(array, dtype=np.float64, order="C")


def host_copy(tensor: Tensor) -> Tensor | np.ndarray:
    """A CPU tensor's values now, for a tensor that passed ``check_tensor``'s checks.

    Its version counter counts no write made through memory it shares with numpy
    (``torch.from_numpy``, ``tensor.numpy()``), nor through ``tensor.data``. So only a
    copy keeps the values it had when logged. A 0-d tensor becomes a 0-d float64 array:
    ``tolist`` reads it without a torch operation. Any other becomes a plain tensor of
    its own (``clone``, one torch operation), detached and never an inference tensor, so
    that its version counter can be read like any record's. ``Tensor.numpy()`` would
    mark the caller's storage as not resizable."""
    if not tensor.dim():
        return np.array(tensor.tolist(), dtype=np.float64)
    return plain_clone(tensor)


def plain_clone(tensor: Tensor) -> Tensor:
    """A copy of ``tensor`` that is an ordinary tensor: detached, and not an inference
    tensor even under ``torch.inference_mode()`` (so it has a version counter)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            return tensor.clone()
    return tensor.clone()


def unmask(name: str, value: Any, weight: Any) -> tuple[Any, Any]:
    """A numpy masked array's data, and a weight that is 0 where it is masked (masked
    elements contribute nothing); a masked weight is 0 where masked. Other inputs pass
    through unchanged."""
    if isinstance(weight, MaskedArray):
        weight = np.ma.filled(weight, 0)
    if not isinstance(value, MaskedArray):
        return value, weight
    masked = np.ma.getmaskarray(value)
    data = np.ma.getdata(value)
    if not masked.any():
        return data, weight
    if weight is None:
        return data, ~masked
    if isinstance(weight, Tensor):
        if weight.device.type != "cpu":
            raise TypeError(
                f"metric {name!r}: a numpy masked array's weight must be in host memory, got "
                f"a tensor on {weight.device}"
            )
        weight = check_tensor(name, weight, "weight").to(torch.float64).numpy()
    number = as_number(name, weight, "weight")
    if number is not None:
        check_weight_number(name, number)
        return data, np.where(masked, 0.0, number)
    weights = numeric_array(name, weight, "weight")
    if weights.shape != data.shape:
        raise ValueError(
            f"metric {name!r}: weight shape {weights.shape} does not match value shape {data.shape}"
        )
    return data, np.where(masked, 0.0, weights)


def check_tensor(name: str, tensor: Tensor, what: str = "value") -> Tensor:
    """``tensor`` checked: real, dense (strided), not nested, with data (not meta), and not
    a subclass with a dispatch of its own (``own_dispatch``).

    It is returned detached when it requires grad: a view, so that the record does not
    keep the autograd graph alive."""
    if (
        tensor.dtype in REAL_DTYPES
        and tensor.layout is STRIDED
        and not tensor.is_nested
        and not tensor.is_meta
        and not own_dispatch(tensor)
    ):
        tensor = tracked(tensor)
        return tensor.detach() if tensor.requires_grad else tensor
    raise tensor_error(name, tensor, what)


def own_dispatch(tensor: Tensor) -> bool:
    """Whether ``tensor``'s class dispatches torch operations itself (``DTensor``, whose
    elements lie on several ranks, so that the fold's operations on it would need
    collectives; ``FakeTensor``, which holds no data), unlike a plain tensor or a
    ``Parameter``."""
    return type(tensor) is not Tensor and type(tensor).__torch_dispatch__ is not _PLAIN_DISPATCH


_PLAIN_DISPATCH = Tensor.__torch_dispatch__


def tracked(tensor: Tensor) -> Tensor:
    """``tensor``, or a copy of it (an ordinary tensor) when it is an inference tensor.

    Torch keeps no version counter for an inference tensor: reading it raises. Under
    ``torch.inference_mode()`` it may change in place unnoticed. So, as with a numpy
    array, only a copy keeps the values it had when logged."""
    if not tensor.is_inference():
        return tensor
    with torch.inference_mode(False), torch.no_grad():
        return tensor.clone()


def tensor_error(name: str, tensor: Tensor, what: str = "value") -> TypeError:
    """The error for a tensor ``check_tensor`` refuses, naming the metric and the first
    problem found (complex, not dense or without data, unsupported dtype). Kept apart
    from the checks so that ``rlmetrics._engine.record`` can inline them on its fast path."""
    if tensor.is_complex():
        return TypeError(f"metric {name!r}: {what} must be real, got complex dtype {tensor.dtype}")
    if tensor.layout is not STRIDED or tensor.is_nested or tensor.is_meta:
        if tensor.is_nested:
            problem = "a nested tensor; pass its flat values (for example torch.cat(t.unbind()))"
        elif tensor.is_meta:
            problem = "a meta tensor, which holds no data"
        else:
            problem = f"a {tensor.layout} tensor; pass a dense one (tensor.to_dense())"
        return TypeError(f"metric {name!r}: {what} must be a dense tensor with data, got {problem}")
    if tensor.dtype not in REAL_DTYPES:
        return TypeError(f"metric {name!r}: {what} has unsupported dtype {tensor.dtype}")
    if own_dispatch(tensor):
        return TypeError(own_dispatch_error(name, tensor, what))
    raise AssertionError(f"metric {name!r}: {what} passes every tensor check")  # a caller's bug


def own_dispatch_error(name: str, tensor: Tensor, what: str) -> str:
    """The message for a tensor that ``own_dispatch`` refuses."""
    return (
        f"metric {name!r}: {what} must be a plain tensor, got a {type(tensor).__name__}, whose "
        "class runs torch operations itself; log a plain tensor (for a DTensor, its local "
        "shard, to_local(), or the whole tensor, full_tensor())"
    )


def check_weight_number(name: str, weight: float) -> None:
    """A python weight must be finite and non-negative."""
    if not weight >= 0 or math.isinf(weight):
        raise ValueError(f"metric {name!r}: weights must be finite and >= 0, got {weight!r}")
