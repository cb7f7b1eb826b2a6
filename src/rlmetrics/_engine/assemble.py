"""A step's records as flat arrays: the fold's first step.

Records are python numbers, host arrays of any shape and real dtype, and tensors, in
call order per metric. ``Parts`` lays a set of metrics' records out as flat parts (each
run of python numbers one array), and ``assemble`` joins parts into one float64 array
(numpy) or tensor (on a device) with a number of torch operations that depends on the
shape classes present, not on how many parts there were.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlmetrics.kinds.base import MetricRecords
from rlmetrics.kinds.batch import Array, to_device


def joined(arrays: list[Array], device: torch.device | None) -> Array:
    """Host arrays and (on a device) tensors as one 1-D array on the fold's backend
    (an empty float64 one for none)."""
    if not arrays:
        return on_backend(np.zeros(0), device)
    if device is not None:
        arrays = [a if isinstance(a, Tensor) else to_device(a, device) for a in arrays]
        return torch.cat(arrays) if len(arrays) > 1 else arrays[0]
    return np.concatenate(arrays) if len(arrays) > 1 else arrays[0]


class Parts:
    """Metrics' records as flat parts (host arrays or tensors), metric by metric in call
    order; each run of python numbers, across metrics, becomes one array."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self.weights: list[Any] = []
        self.call_lengths: list[int] = []
        self.lengths: list[int] = []
        self.numbers: list[float] = []
        self.number_weights: list[float] = []

    def add(self, acc: MetricRecords) -> None:
        values, weights = acc.values, acc.weights
        if not acc.arrays:  # python numbers only: checked when logged, never rejected
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
            size = value.numel() if isinstance(value, Tensor) else value.size
            self.values.append(value)
            if weight is None or type(weight) is float:
                self.weights.append(np.full(size, 1.0 if weight is None else weight))
            else:
                self.weights.append(weight)
            self.call_lengths.append(size)
        self.lengths.append(sum(self.call_lengths[start:]))

    def flush(self) -> None:
        """End the current run of python numbers."""
        if self.numbers:
            self.values.append(np.array(self.numbers))
            self.weights.append(np.array(self.number_weights))
            self.numbers, self.number_weights = [], []


def assemble(parts: Sequence[Any], device: torch.device | None) -> Array:
    """Flat parts (host arrays of any shape and real dtype, tensors) as one 1-D float64
    array (``device`` None) or tensor on ``device``, in order.

    Tensors are joined by class (device, dtype, 0-d ones stacked, others by their
    trailing shape), so the number of torch operations depends on the classes, not on
    the number of parts; a permutation restores the order when there are several.
    """
    host = [i for i, part in enumerate(parts) if not isinstance(part, Tensor)]
    classes: dict[tuple[Any, ...], list[int]] = {}
    for i, part in enumerate(parts):
        if isinstance(part, Tensor):
            key = (part.device, part.dtype, part.dim() == 0, part.shape[1:])
            classes.setdefault(key, []).append(i)
    blocks: list[Any] = []
    order: list[int] = []
    if host:
        flat = [_flat_host(parts[i]) for i in host]
        blocks.append(np.concatenate(flat) if len(flat) > 1 else flat[0])
        order += host
    target = device or torch.device("cpu")
    for (_, _, scalar, _), members in classes.items():
        tensors = [parts[i] for i in members]
        blocks.append(_tensor_block(tensors, scalar, target))
        order += members
    if device is None:
        blocks = [b if isinstance(b, np.ndarray) else b.numpy() for b in blocks]
        flat_all = np.concatenate(blocks) if len(blocks) > 1 else blocks[0] if blocks else None
        if flat_all is None:
            return np.zeros(0)
    else:
        blocks = [to_device(b, device) if isinstance(b, np.ndarray) else b for b in blocks]
        if not blocks:
            return torch.zeros(0, dtype=torch.float64, device=device)
        flat_all = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
    if len(blocks) > 1 and order != sorted(order):
        sizes = [part_size(parts[i]) for i in order]
        permutation = _permutation(order, sizes)
        flat_all = flat_all[permutation if device is None else on_backend(permutation, device)]
    return flat_all


def _flat_host(part: np.ndarray) -> np.ndarray:
    if part.ndim == 1 and part.dtype == np.float64:
        return part
    return np.asarray(part, dtype=np.float64).reshape(-1)


def _tensor_block(tensors: list[Tensor], scalar: bool, target: torch.device) -> Tensor:
    """Tensors of one class (device, dtype, 0-d or trailing shape) as one flat float64
    tensor on ``target``: joined in their own dtype (a copy), then converted, which costs
    less than joining into float64 and is exact (one dtype per class). ``reshape``, not
    ``view``: ``cat`` keeps its inputs' memory format (channels_last stays so), whose
    elements lie out of their logical order."""
    joined = torch.stack(tensors) if scalar else torch.cat(tensors).reshape(-1)
    return joined.to(target, torch.float64)


def part_size(part: Any) -> int:
    """The elements of a record or part: a tensor, an array or a python number (one)."""
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
