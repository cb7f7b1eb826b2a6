"""Copies of CPU tensors for a host fold, read straight from their memory.

A logged CPU tensor is copied at its log call (``rlmetrics._engine.record``): torch
counts no write made through memory it shares with numpy, nor through ``tensor.data``.
A ``clone`` costs a torch dispatch, memory from the allocator and a tensor to free at
the fold: for a tensor of a thousand elements, several times the copy itself. Here a
copy is one ``memmove`` of the tensor's bytes, without a torch operation:

``MemoryReader`` reads a tensor's bytes into a bytes object (immutable: nothing can
write to the copy after). The record is a ``HostCopy``: those bytes and their numpy
dtype, a plain tuple, made for less than an array. The fold joins the bytes of a step's
copies at once (``rlmetrics._engine.assemble``); anything else reads a copy as an
array (``as_array``). A weight's bytes are compared with the last copy's first: a mask
logged again unchanged is recorded as that copy again (``record.CheckedWeight.host_copy``).

Only a plain tensor whose memory holds its elements as they read is copied so: a
contiguous one, without a negative-view bit, with elements and a storage. For any other
``read`` returns None, and the caller clones.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch
from torch import Tensor

NUMPY_DTYPE_OF: dict[torch.dtype, np.dtype[Any]] = {
    torch.float64: np.dtype(np.float64),
    torch.float32: np.dtype(np.float32),
    torch.float16: np.dtype(np.float16),
    torch.bool: np.dtype(np.bool_),
    torch.uint8: np.dtype(np.uint8),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
}
"""The tensor dtypes a log call takes that numpy holds too, and numpy's dtype of each."""
_CHARS: dict[int, Any] = {}  # per size in bytes, ctypes' array type of that many chars
_MAX_CHARS = 1024


def _chars(size: int) -> Any:
    """ctypes' array type of ``size`` chars, kept for the sizes seen last. Reading
    memory through one (``from_address(...).raw``) costs about half of ``string_at``,
    a foreign call."""
    chars = _CHARS.get(size)
    if chars is None:
        if len(_CHARS) >= _MAX_CHARS:
            _CHARS.clear()
        chars = _CHARS[size] = ctypes.c_char * size
    return chars


def _memory(tensor: Tensor) -> tuple[int, int]:
    """The address and size in bytes of ``tensor``'s elements, or (0, 0) where its memory
    does not hold them as they read (see the module's docstring)."""
    if not tensor.is_contiguous() or tensor.is_neg():
        return 0, 0
    try:
        address = tensor.data_ptr()
    except RuntimeError:  # a tensor without storage (a functorch wrapper, a fake one)
        return 0, 0
    return (address, tensor.nbytes) if address else (0, 0)


class MemoryReader:
    """Reads plain CPU tensors' elements, as bytes (immutable: nothing writes to them).

    A tensor logged again from the same memory (a reused buffer) is read through a
    numpy view of that memory, made at its second read: cheaper than a ctypes array
    made for each read. The view is read only right after the tensor logged showed
    that memory as its own, of the same size, so it never reads memory that no live
    tensor holds. The log call's hot path: each step is written out.
    """

    __slots__ = ("address", "size", "view")

    def __init__(self) -> None:
        self.address = self.size = 0  # the last read's memory
        self.view: np.ndarray | None = None  # of that memory, from its second read

    def read(self, tensor: Tensor) -> bytes | None:
        """``tensor``'s elements now, in its dtype and row-major order, or None where its
        memory does not hold them as they read (see the module's docstring)."""
        if not tensor.is_contiguous() or tensor.is_neg():
            return None
        try:
            address = tensor.data_ptr()
        except RuntimeError:  # a tensor without storage (a functorch wrapper, a fake one)
            return None
        size = tensor.nbytes
        if not address or not size:
            return None
        if address != self.address or size != self.size:
            self.address, self.size, self.view = address, size, None
            return (_CHARS.get(size) or _chars(size)).from_address(address).raw
        view = self.view
        if view is None:
            view = self.view = np.frombuffer(_chars(size).from_address(address), np.uint8)
        return view.tobytes()


def memory_view(tensor: Tensor) -> np.ndarray | None:
    """A flat numpy view of a plain CPU tensor's elements, made without a torch operation
    (``Tensor.numpy`` dispatches one, and marks the tensor's storage as not resizable);
    None where its memory does not hold them as they read, or numpy lacks its dtype.
    Valid while the tensor holds that memory."""
    dtype = NUMPY_DTYPE_OF.get(tensor.dtype)
    address, size = _memory(tensor) if dtype is not None else (0, 0)
    if not size:
        return None
    return np.frombuffer(_chars(size).from_address(address), dtype)


HostCopy = tuple
"""A CPU tensor's copy for a host fold: ``(bytes, numpy dtype, elements)``, its elements
as ``MemoryReader.read`` gave them, flat. No other record is a tuple."""


def as_array(part: Any) -> Any:
    """A record or part as the fold reads it: a ``HostCopy`` as a flat read-only numpy
    array, anything else as it is."""
    return np.frombuffer(part[0], part[1]) if type(part) is tuple else part
