"""Copies of CPU tensors for a host fold, written straight from their memory.

A logged CPU tensor is copied at its log call (``rlmetrics._engine.record``): torch
counts no write made through memory it shares with numpy, nor through ``tensor.data``.
A ``clone`` costs a torch dispatch, memory from the allocator and a tensor to free at
the fold: for a tensor of a thousand elements, several times the copy itself. Here a
copy is one ``memmove`` of the tensor's bytes, without a torch operation:

The metric's ``CopyArena`` writes a tensor's bytes from its memory after the step's
earlier copies, into memory the arena keeps from step to step; nothing else writes
there until the fold. The record is a ``HostCopy``: where the bytes lie and their numpy
dtype, a plain tuple. The fold reads a metric whose records are all copies in its
arenas, in order, as the arenas themselves (``CopyArena.array``): no join, no Python
step per record. Anything else reads a copy as an array (``as_array``).

Only a plain tensor whose memory holds its elements as they read is copied so: a
contiguous one, without a negative-view bit, with elements and a storage. For any other
``CopyArena.copy`` returns None, and the caller clones.
"""

from __future__ import annotations

import ctypes
import io
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


class CopyArena:
    """One metric's host copies of one side (its values, or its weights) this step,
    their bytes one after the other in an ``io.BytesIO`` kept from step to step.

    A copy is one ``write`` from the tensor's memory into memory recent steps paged
    in, with no object made for its bytes (``copy``). The fold reads the arena as one
    array (``array``) when every record of that side is a copy written here this step
    (``calls`` of them), all of one dtype: the metric's records already lie joined,
    in call order.

    A tensor logged again from the same memory (a reused buffer, one mask) is read
    through a numpy view of that memory, made at its second copy: cheaper than a
    ctypes array made for each copy. The view is read only right after the tensor
    logged showed that memory as its own, of the same size, so it never reads memory
    that no live tensor holds.

    A file that an array still views (one kept past its fold, by a traceback say) cannot
    be written: a new one takes its place, and the copies already made keep the old one
    (each ``HostCopy`` names its file). A file that recent steps used little of is
    given back (``reset``), and the arena of a metric that recent steps did not log
    (``idle``): one huge step does not hold its memory for the rest of the run.
    """

    __slots__ = ("address", "calls", "dtype", "file", "little_used", "one_dtype", "size", "view")

    def __init__(self) -> None:
        self.file = io.BytesIO()
        self.calls = 0  # copies written into ``file`` since the last reset
        self.dtype: np.dtype[Any] | None = None  # the last copy's
        self.one_dtype = True  # whether this step's copies in ``file`` share ``dtype``
        self.little_used = 0  # resets in a row that found the file little used
        self.address = self.size = 0  # the last copy's memory
        self.view: np.ndarray | None = None  # of that memory, from its second copy

    def __reduce__(self) -> tuple[type[CopyArena], tuple[()]]:
        """A copy (a pickled or deep-copied tracker, which folded first) is a new arena:
        no copies, and no view of memory that the copy's tensors do not hold."""
        return CopyArena, ()

    def copy(self, tensor: Tensor, elements: int) -> HostCopy | None:
        """Copy a plain CPU tensor's ``elements`` now, after this step's earlier copies,
        and return its record; or None where its memory does not hold them as they read
        (see the module's docstring) and the caller clones. The log call's hot path:
        each step is written out."""
        dtype = NUMPY_DTYPE_OF.get(tensor.dtype)
        if dtype is None or not tensor.is_contiguous() or tensor.is_neg():
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
            memory: Any = (_CHARS.get(size) or _chars(size)).from_address(address)
        else:
            memory = self.view
            if memory is None:
                memory = self.view = np.frombuffer(_chars(size).from_address(address), np.uint8)
        file = self.file
        offset = file.tell()
        try:
            file.write(memory)
        except BufferError:  # still viewed: the copies so far keep that file
            file = self.file = io.BytesIO()
            self.calls, self.one_dtype, offset = 0, True, 0
            file.write(memory)
        if dtype is not self.dtype:
            self.one_dtype = not self.calls
            self.dtype = dtype
        self.calls += 1
        return (file, dtype, elements, offset)

    def holds(self, calls: int) -> bool:
        """Whether this step's ``calls`` records of its side are all copies written here,
        of one dtype (``array`` then gives them all)."""
        return self.calls == calls and self.one_dtype

    def array(self, elements: int) -> np.ndarray:
        """This step's copies (``holds``), ``elements`` in all, as one flat writable array
        over the file: valid, and the file not written, until the array is dropped."""
        return np.frombuffer(self.file.getbuffer(), self.dtype, elements)

    def idle(self) -> bool:
        """A step that did not log the metric. Returns whether the arena is to be given
        back: ``ARENA_SHRINK_AFTER`` steps in a row that made no copy here, or few."""
        self.little_used += 1
        return self.little_used >= ARENA_SHRINK_AFTER

    def reset(self) -> None:
        """A new step: later copies are written from the file's start. A file that
        ``ARENA_SHRINK_AFTER`` steps in a row used under ``1 / ARENA_GROWTH`` of is
        given back. An arena with no copy since its last reset is left as it is."""
        if not self.calls:
            return
        file = self.file
        used, held = file.tell(), file.seek(0, io.SEEK_END)
        if used * ARENA_GROWTH < held:
            self.little_used += 1
            if self.little_used >= ARENA_SHRINK_AFTER:
                self.file, self.little_used = io.BytesIO(), 0
        else:
            self.little_used = 0
        self.file.seek(0)
        self.calls, self.one_dtype = 0, True


ARENA_GROWTH = ARENA_SHRINK_AFTER = 8
"""A ``CopyArena`` whose last ``ARENA_SHRINK_AFTER`` steps used under ``1 / ARENA_GROWTH``
of its file gets a new one (``HostScratch`` keeps its buffers by the same rule)."""


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
"""A CPU tensor's copy for a host fold: ``(file, numpy dtype, elements, offset)``, its
elements flat at byte ``offset`` of the ``io.BytesIO`` a ``CopyArena`` wrote them into.
No other record is a tuple."""


def as_array(part: Any) -> Any:
    """A record or part as the fold reads it: a ``HostCopy`` as a flat numpy array over
    its file (the file is not written while it lives), anything else as it is."""
    if type(part) is tuple:
        return np.frombuffer(part[0].getbuffer(), part[1], part[2], part[3])
    return part
