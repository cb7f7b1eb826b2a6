"""The records of a fold joined into flat arrays: one for the values, one for the weights.

``Parts`` lays a set of metrics' records out as flat parts: host arrays of any shape
and real dtype, tensors, and each run of python numbers as one array. ``assemble``
joins parts into one float64 array (the host) or tensor (a device). Tensors are joined
by class (device, dtype, trailing shape), so the number of torch operations follows the
classes present, not the number of parts. On the host, a few or large parts of several
classes are instead copied into place one by one, with numpy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlmetrics._engine.copies import as_array, memory_view
from rlmetrics._engine.inputs import REAL_DTYPES
from rlmetrics._engine.plan import HostScratch
from rlmetrics._engine.record import BOOL, MetricRecords
from rlmetrics.kinds.batch import Array, to_device

SCRATCH_JOINS = {
    torch.float32: (np.float64, np.float32),
    BOOL: (np.bool_, np.bool_),
    np.dtype(np.float32): (np.float64, np.float32),
    np.dtype(np.bool_): (np.bool_, np.bool_),
}
"""The dtypes of tensors, or of host arrays, that a host fold joins into its scratch:
per dtype, the dtype asked of the join and the buffer's (float32 values, widened later;
bool masks). Host arrays of float32 are CPU tensors' copies (``rlmetrics._engine.copies``)."""

MASK_DTYPES = frozenset({BOOL, np.dtype(np.bool_)})
"""The dtypes of a weight part (a tensor or a host array) that is a bool mask."""

IN_PLACE_PARTS = 32
IN_PLACE_PART_SIZE = 256
"""A host fold's parts of several classes are copied into place one by one when they
are few (at most ``IN_PLACE_PARTS``), or large (``IN_PLACE_PART_SIZE`` elements each on
average) and interleaved: a copy per part costs more Python than a share of a class's
join, but saves the joins, their conversions and the permutation that restores the
order of interleaved classes, a pass of its own over every element."""

NUMPY_DTYPES = REAL_DTYPES - {torch.bfloat16}
"""The tensor dtypes a log call takes that numpy holds too: CPU tensors a host fold
reads as arrays."""


_get_dtype = attrgetter("dtype")


def made_anew(value: np.ndarray, parts: list[Any]) -> bool:
    """Whether ``assemble`` made ``value`` (a join, a conversion or a tensor block's
    copy) rather than handing back a host part or a view of one."""
    return isinstance(value.base, (Tensor, type(None))) and all(value is not p for p in parts)


def joined(arrays: list[Array], device: torch.device | None) -> Array:
    """Host arrays and (on a device) tensors as one 1-D array on the fold's backend
    (an empty float64 one for none)."""
    if not arrays:
        return on_backend(np.zeros(0), device)
    if device is not None:
        arrays = [a if isinstance(a, Tensor) else to_device(a, device) for a in arrays]
        return torch.cat(arrays) if len(arrays) > 1 else arrays[0]
    return np.concatenate(arrays) if len(arrays) > 1 else arrays[0]


ONLY_TENSORS = {Tensor}
ONLY_ARRAYS = {np.ndarray}
ONLY_COPIES = {tuple}  # copies.HostCopy
_get_size = attrgetter("size")
_get_copy_dtype, _get_copy_size = itemgetter(1), itemgetter(2)
_SIZE_OF: dict[type, Callable[[Any], int]] = {
    Tensor: Tensor.numel,
    np.ndarray: _get_size,
    tuple: _get_copy_size,
}


def _types(items: Sequence[Any]) -> set[type]:
    """The types among ``items``."""
    return set(map(type, items))


class Parts:
    """Metrics' records as flat parts (host arrays or tensors), metric by metric in call
    order; each run of python numbers, across metrics, becomes one array.

    A metric whose values (and weights, unless it has none) are all host copies in its
    arenas is one part, the arena itself (``copies.CopyArena``); ``arenas`` counts such
    parts, which the fold may write over."""

    def __init__(self) -> None:
        self.arenas = 0
        self.values: list[Any] = []
        self.weights: list[Any] = []
        self.call_lengths: list[int] = []
        self.lengths: list[int] = []
        self.numbers: list[float] = []
        self.number_weights: list[float] = []

    def add(self, records: MetricRecords) -> None:
        values, weights = records.values, records.weights
        if self._add_arenas(records):
            return
        types = _types(values)
        if types in (ONLY_TENSORS, ONLY_COPIES, ONLY_ARRAYS) and _types(weights) == types:
            # tensor (or host copy, or array) values with weights of the same type (a
            # mask, most often): the parts as they are
            self.flush()
            sizes = list(map(_SIZE_OF[next(iter(types))], values))
            self.values += values
            self.weights += weights
            self.call_lengths += sizes
            self.lengths.append(sum(sizes))
            return
        if not records.arrays:  # python numbers only: checked when logged, never rejected
            self.numbers += values
            self.number_weights += weights
            self.call_lengths += [1] * len(values)
            self.lengths.append(len(values))
            return
        start = len(self.call_lengths)
        for value, weight in zip(values, weights, strict=True):
            if type(value) is float:
                self.numbers.append(value)
                self.number_weights.append(weight)
                self.call_lengths.append(1)
                continue
            self.flush()
            value, weight = as_array(value), as_array(weight)
            size = value.numel() if isinstance(value, Tensor) else value.size
            self.values.append(value)
            if weight is None or (type(weight) is float and weight == 1.0):  # all selected
                self.weights.append(np.ones(size, dtype=np.bool_))
            elif type(weight) is float:
                self.weights.append(np.full(size, weight))
            else:
                self.weights.append(weight)
            self.call_lengths.append(size)
        self.lengths.append(sum(self.call_lengths[start:]))

    def _add_arenas(self, records: MetricRecords) -> bool:
        """Add the metric's records as its arenas, where they hold them all: every value a
        host copy in its value arena, every weight one in its weight arena or None (a
        weight of 1). Else add nothing and return False."""
        values, value_arena = records.values, records.value_copies
        calls = len(values)
        if value_arena is None or not value_arena.holds(calls):
            return False
        weight_arena = records.weight_copies
        if weight_arena is not None and not weight_arena.holds(calls):
            weight_arena = None
        if weight_arena is None and records.weights.count(None) != calls:
            return False
        self.flush()
        sizes = list(map(_get_copy_size, values))
        size = sum(sizes)
        self.values.append(value_arena.array(size))
        self.weights.append(
            np.ones(size, np.bool_) if weight_arena is None else weight_arena.array(size)
        )
        self.call_lengths += sizes
        self.lengths.append(size)
        self.arenas += 1
        return True

    def flush(self) -> None:
        """End the current run of python numbers."""
        if self.numbers:
            self.values.append(np.array(self.numbers))
            self.weights.append(np.array(self.number_weights))
            self.numbers, self.number_weights = [], []


def assemble(
    parts: Sequence[Any],
    device: torch.device | None,
    dtype: type = np.float64,
    *,
    scratch: HostScratch | None = None,
    writable: bool = False,
) -> Array:
    """Flat parts as one 1-D array, in order: float64 on the host (``device`` None), or a
    float64 tensor on ``device``.

    Parts are host arrays of any shape and real dtype, host copies of CPU tensors
    (``copies.HostCopy``), or tensors. On the host, ``dtype`` may be ``np.bool_``
    instead, for parts that are all bool masks. In a host fold (``scratch``), host arrays
    (host copies among them) and 1-D tensors all of float32 or all of bool are joined
    into the scratch buffer of their dtype. Float32 values stay float32 so, for
    ``HostBatch`` to widen. ``writable``: the parts are the fold's to write over (a
    metric's ``copies.CopyArena``), so a lone one of those dtypes is itself the join.

    Tensors are joined by class: device, dtype, and 0-d ones stacked, others by their
    trailing shape. So the number of torch operations follows the classes, not the
    number of parts. A permutation restores the order when the classes interleave. On
    the host, parts of several classes that are few, or large and interleaved
    (``IN_PLACE_PARTS``), are instead copied into place one by one, with numpy.
    """
    if tuple in _types(parts):  # host copies
        parts = list(map(as_array, parts))
    host, classes = _classes(parts, device is not None)
    if scratch is not None and host and not classes:
        joined_host = _host_into_scratch(parts, dtype, scratch, writable)
        if joined_host is not None:
            return joined_host
    if scratch is not None and not host and len(classes) == 1:
        (((part_dtype, dims, *_), members),) = classes.items()
        asked, kept = SCRATCH_JOINS.get(part_dtype, (None, None))
        if dims == 1 and asked is dtype:
            tensors = [parts[i] for i in members]
            size = sum(map(Tensor.numel, tensors))
            out = scratch.take(size, kept)
            torch.cat(tensors, out=torch.from_numpy(out))
            return out
    several = bool(host) + len(classes) > 1  # blocks to join; one class needs no order
    order = host + [i for members in classes.values() for i in members] if several else []
    interleaved = several and order != sorted(order)  # the blocks need a permutation
    if several and device is None and all(key[0] in NUMPY_DTYPES for key in classes):
        sizes = list(map(part_size, parts))
        large = interleaved and sum(sizes) >= IN_PLACE_PART_SIZE * len(parts)
        if len(parts) <= IN_PLACE_PARTS or large:
            arrays = [p if isinstance(p, np.ndarray) else memory_view(p) for p in parts]
            # a tensor without a view is read by Tensor.numpy, a torch operation: at most
            # IN_PLACE_PARTS of them, so that a fold's operations do not follow its calls
            if sum(a is None for a in arrays) <= IN_PLACE_PARTS:
                return _in_place(parts, arrays, sizes, dtype)
    blocks: list[Any] = []
    if host:
        flat = [_flat_host(parts[i], dtype) for i in host]
        blocks.append(np.concatenate(flat) if len(flat) > 1 else flat[0])
    target = device or torch.device("cpu")
    tensor_dtype = BOOL if dtype is np.bool_ else torch.float64
    for key, members in classes.items():
        tensors = [parts[i] for i in members]
        blocks.append(_tensor_block(tensors, key[1] == 0, target, tensor_dtype))
    if device is None:
        blocks = [b if isinstance(b, np.ndarray) else b.numpy() for b in blocks]
        flat_all = np.concatenate(blocks) if len(blocks) > 1 else blocks[0] if blocks else None
        if flat_all is None:
            return np.zeros(0, dtype=dtype)
    else:
        blocks = [to_device(b, device) if isinstance(b, np.ndarray) else b for b in blocks]
        if not blocks:
            return torch.zeros(0, dtype=torch.float64, device=device)
        flat_all = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
    if interleaved:
        sizes = [part_size(parts[i]) for i in order]
        permutation = _permutation(order, sizes)
        flat_all = flat_all[permutation if device is None else on_backend(permutation, device)]
    return flat_all


def _kept_dtype(dtypes: set[Any], dtype: type) -> Any:
    """The dtype of the scratch buffer that parts of ``dtypes`` asked as ``dtype`` are
    joined into: where they are all of one dtype ``SCRATCH_JOINS`` joins so; else None."""
    if len(dtypes) != 1:
        return None
    asked, kept = SCRATCH_JOINS.get(dtypes.pop(), (None, None))
    return kept if asked is dtype else None


def _host_into_scratch(
    parts: Sequence[Any], dtype: type, scratch: HostScratch, writable: bool
) -> Any:
    """Host arrays all of one dtype that ``SCRATCH_JOINS`` joins (float32 asked as
    float64, bool as bool) as one flat array in ``scratch``'s buffer of that dtype, or
    a lone one the caller may write over (``writable``) as it is; else None."""
    kept = _kept_dtype(set(map(_get_dtype, parts)), dtype)
    if kept is None:
        return None
    flat = [part.reshape(-1) if part.ndim != 1 else part for part in parts]
    if writable and len(flat) == 1:
        return flat[0]
    out = scratch.take(sum(map(len, flat)), kept)
    if len(flat) > 1:
        return np.concatenate(flat, out=out)
    out[:] = flat[0]
    return out


def _classes(
    parts: Sequence[Any], devices: bool
) -> tuple[list[int], dict[tuple[Any, ...], list[int]]]:
    """The host parts (indices), and the tensor parts by class: dtype, dimensions,
    trailing shape beyond one dimension, and (``devices``: a device fold, which may
    hold tensors of several devices) device. A host fold's tensors are all plain CPU
    ones."""
    host: list[int] = []
    classes: dict[tuple[Any, ...], list[int]] = {}
    types = _types(parts)
    if types == ONLY_ARRAYS:  # host arrays only: a host fold's copies of CPU tensors, most often
        return list(range(len(parts))), classes
    if not devices and types == ONLY_TENSORS:  # one class, most often: 1-D, one dtype
        dtypes = set(map(_get_dtype, parts))
        if len(dtypes) == 1 and set(map(Tensor.dim, parts)) == {1}:
            return host, {(dtypes.pop(), 1): list(range(len(parts)))}
    for i, part in enumerate(parts):
        if not isinstance(part, Tensor):
            host.append(i)
            continue
        dims = part.dim()
        key: tuple[Any, ...] = (
            (part.dtype, dims) if dims < 2 else (part.dtype, dims, part.shape[1:])
        )
        if devices:
            key += (part.device,)
        members = classes.get(key)
        if members is None:
            classes[key] = [i]
        else:
            members.append(i)
    return host, classes


def _in_place(
    parts: Sequence[Any], arrays: list[np.ndarray | None], sizes: list[int], dtype: type
) -> np.ndarray:
    """Host parts and CPU tensors of dtypes numpy holds, each copied (and converted) into
    its place in one new ``dtype`` array: already in order, one pass over the data.
    ``arrays``: each part as an array (a tensor's ``copies.memory_view``), or None for a
    tensor read by ``Tensor.numpy``."""
    out: np.ndarray = np.empty(sum(sizes), dtype)
    start = 0
    for part, array, size in zip(parts, arrays, sizes, strict=True):
        end = start + size
        out[start:end] = (part.numpy() if array is None else array).reshape(-1)
        start = end
    return out


def _flat_host(part: np.ndarray, dtype: type = np.float64) -> np.ndarray:
    if part.ndim == 1 and part.dtype == dtype:
        return part
    return np.asarray(part, dtype=dtype).reshape(-1)


def _tensor_block(
    tensors: list[Tensor], scalar: bool, target: torch.device, dtype: torch.dtype
) -> Tensor:
    """Tensors of one class (device, dtype, 0-d or trailing shape) as one flat copy of
    ``dtype`` on ``target``.

    They are joined in their own dtype, then converted: exact, as a class has one dtype.
    A lone tensor of another dtype is only converted, since the conversion copies.
    ``reshape``, not ``view``: ``cat`` keeps its inputs' memory format (channels_last
    stays so), whose elements lie out of their logical order."""
    if len(tensors) == 1 and not scalar and tensors[0].dtype != dtype:
        return tensors[0].reshape(-1).to(target, dtype)
    joined = torch.stack(tensors) if scalar else torch.cat(tensors).reshape(-1)
    return joined.to(target, dtype)


def part_dtypes(parts: Sequence[Any]) -> set[Any]:
    """The dtypes of parts: tensors', arrays' and host copies'."""
    types = _types(parts)
    if tuple not in types:
        return set(map(_get_dtype, parts))
    if types == ONLY_COPIES:
        return set(map(_get_copy_dtype, parts))
    return {part[1] if type(part) is tuple else part.dtype for part in parts}


def part_size(part: Any) -> int:
    """The elements of a record or part: a tensor, an array, a host copy or a python
    number (one)."""
    if type(part) is tuple:
        return part[2]
    return part.numel() if isinstance(part, Tensor) else np.size(part)


def _permutation(order: list[int], sizes: list[int]) -> np.ndarray:
    """Where each element of the parts, in their original order, lies in the blocks
    laid out in ``order`` (part indices) with ``sizes`` elements each."""
    sizes_arr = np.asarray(sizes, dtype=np.int64)
    laid_start = np.cumsum(sizes_arr) - sizes_arr
    original = np.argsort(np.asarray(order), kind="stable")  # part i's place in order
    lengths = sizes_arr[original]
    source_start = laid_start[original]
    target_start = np.cumsum(lengths) - lengths
    return np.repeat(source_start - target_start, lengths) + np.arange(int(lengths.sum()))


def on_backend(array: np.ndarray, device: torch.device | None) -> Array:
    """A host array on the fold's backend (itself for the host)."""
    return array if device is None else to_device(array, device)
