"""One log call: the checks that need no data, then the value and weight recorded.

A log call computes nothing. It appends python numbers, host arrays and tensors to the
metric's ``MetricRecords`` as they are, or as copies (below). ``rlmetrics._engine.fold``
reduces them once per step. What needs no data is checked here and raises at once,
naming the metric: types, shapes, dtypes, and python numbers (a negative weight; a
non-finite value under ``nonfinite="error"``). What needs data is checked at the fold,
which rejects and counts the call: negative or non-finite weights in an array, and
non-finite values under ``nonfinite="error"``.

Records keep references, so nothing logged may change before the step ends:

* A numpy array or list is copied here: numpy cannot notice a later write.
* A CPU tensor is copied too, unless ``Tracker.copy_cpu_tensors`` is False. Torch
  counts no write made through memory it shares with numpy, nor through
  ``tensor.data``. For a host fold the copy is the tensor's bytes, written from its
  memory after the metric's earlier copies of the step (``rlmetrics._engine.copies``).
  Else the copy is a clone (``inputs.host_copy``).
* An inference tensor is copied: torch keeps it no version counter.
* A tensor recorded by reference (a device tensor) has its version counter recorded.
  An in-place change before the fold raises there (docs/concepts.md lists the changes
  torch counts).

A tensor that requires grad is detached (one view), so the record does not keep its
autograd graph alive. Both paths, ``record_tensor`` and ``record_prepared``, end in
``_append``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import numpy as np
import torch
from torch import Tensor

from rlmetrics._engine.copies import CopyArena, as_array
from rlmetrics._engine.inputs import (
    REAL_DTYPES,
    STRIDED,
    MaskedArray,
    as_number,
    check_tensor,
    check_weight_number,
    host_copy,
    numeric_array,
    plain_clone,
    tensor_error,
    tracked,
    unmask,
)
from rlmetrics.kinds.base import NONFINITE_SLOT, Kind
from rlmetrics.kinds.mean import Mean

BOOL = torch.bool
INFERENCE_MODE = torch.is_inference_mode_enabled
CPU = torch.device("cpu")


class NumberRecords:
    """A tracker's python-number log calls, flat and in call order.

    Lists hold the value and metric row of each call, and the position and weight of
    each call whose weight is not 1. A plain log call appends two numbers. The fold turns
    each list into one array, however many metrics there were.

    A metric's numbers go here until its first array or tensor record of the step
    (``MetricRecords.in_number_records``). Later ones go to its own records, after that
    one, so each metric's calls keep their order.
    """

    __slots__ = ("rows", "values", "weight_at", "weights")

    def __init__(self) -> None:
        self.values: list[float] = []
        self.rows: list[int] = []
        self.weight_at: list[int] = []  # the calls whose weight is not 1
        self.weights: list[float] = []  # and their weights

    def clear(self) -> None:
        self.values.clear()
        self.rows.clear()
        self.weight_at.clear()
        self.weights.clear()

    def value_array(self) -> np.ndarray:
        """The values, a float64 array."""
        return np.fromiter(self.values, np.float64, len(self.values))

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Values and weights, float64 arrays (the rows stay a list: the fold compares
        them with the last step's)."""
        weights = np.ones(len(self.values))
        if self.weight_at:
            weights[np.fromiter(self.weight_at, np.int64, len(self.weight_at))] = self.weights
        return self.value_array(), weights


@dataclass(slots=True, eq=False)
class MetricRecords:
    """One metric in a Tracker: its kind, its row of the state table and this step's records.

    A log call appends its value and weight as logged: no arithmetic. Python numbers go
    to the tracker's flat ``NumberRecords`` while ``in_number_records`` holds; anything
    else goes to ``values`` and ``weights``. At step end, or when the records pass
    their memory bound, ``rlmetrics._engine.fold`` reduces them into the metric's row
    of the ``StateTable``. Host data folds into the host half of the table. A metric
    with a tensor record folds on that tensor's device, with no host sync.
    """

    kind: Kind
    table: Any  # the tracker's rlmetrics._engine.table.StateTable
    row: int
    name: str = ""
    # Calls whose data checks run at the fold, where they may be rejected.
    num_deferred_checks: int = 0
    # Whether any other call (or a merge) was taken. A metric that only rejected calls
    # made is dropped once they are reported: a python call that raises makes no metric.
    accepted_a_call: bool = False
    # The records since the last fold, in call order.
    values: list[Any] = field(default_factory=list)
    weights: list[Any] = field(default_factory=list)
    record_device: torch.device | None = None  # where the fold runs: a tensor record's device
    arrays: bool = False  # whether any record is not a python number
    # Each tensor recorded by reference, then its version at its log call. Flat, so that
    # a log call extends it once.
    versions: list[Any] = field(default_factory=list)
    # Whether python numbers go to the tracker's flat records: until the step's first
    # array record, and only for a kind that takes single numbers (parts == 1).
    in_number_records: bool = False
    # The kind's name, and whether it limits a call's size (parts, keeps_latest). Every
    # log call reads them, so they are copied from the kind (architecture.md, "Performance").
    kind_name: str = field(default="", init=False)
    checks_call_size: bool = field(default=False, init=False)
    # Where a host fold's log calls copy CPU tensors' values and weights (made at the
    # first such copy; kept, with their memory, from step to step).
    value_copies: CopyArena | None = field(default=None, init=False)
    weight_copies: CopyArena | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.in_number_records = self.kind.parts == 1
        self.kind_name = self.kind.name
        self.checks_call_size = self.kind.parts != 1 or self.kind.keeps_latest

    def clear(self) -> None:
        """A new step: no records, no calls counted."""
        self.clear_records()
        self.num_deferred_checks = 0
        self.accepted_a_call = False

    def clear_records(self) -> None:
        """Drop the records (folded, or a new step)."""
        self.values.clear()
        self.weights.clear()
        self.versions.clear()
        self.record_device = None
        self.arrays = False
        self.in_number_records = self.kind.parts == 1
        if self.value_copies is not None:
            self.value_copies.reset()
        if self.weight_copies is not None:
            self.weight_copies.reset()

    def new_arena(self, side: str) -> CopyArena:
        """A new arena for the metric's ``side`` ("value" or "weight") copies."""
        arena = CopyArena()
        setattr(self, f"{side}_copies", arena)
        return arena

    def idle(self) -> None:
        """A step that did not log this metric: its arenas are dropped after several
        such steps in a row (``CopyArena.idle``), so a name that is gone does not keep
        its copies' memory while the tracker pools it."""
        if self.value_copies is not None and self.value_copies.idle():
            self.value_copies = None
        if self.weight_copies is not None and self.weight_copies.idle():
            self.weight_copies = None

    def count(self, slot: int, amount: float = 1.0) -> None:
        """Add to a framework count on the host (``NONFINITE_SLOT`` or ``REJECTED_SLOT``)."""
        self.table.count(self.row, slot, amount)


def record_number(
    records: MetricRecords,
    name: str,
    value: float,
    weight: float,
    nonfinite: str,
    numbers: NumberRecords,
) -> None:
    """Record one python number with a python weight (checked now: it is on the host),
    into ``numbers`` while the metric has no array record this step."""
    if weight != 1.0:
        check_weight_number(name, weight)
        if weight == 0.0:  # contributes nothing, NaN or not, under every policy
            records.accepted_a_call = True  # but the metric exists (see Tracker._forget_rejected)
            return
    if records.checks_call_size:
        _check_size(records, name, 1, ())
    if nonfinite != "propagate" and not math.isfinite(value):
        if nonfinite == "error":
            raise ValueError(f"metric {name!r}: non-finite value {value!r} (nonfinite='error')")
        records.count(NONFINITE_SLOT)
        return
    records.accepted_a_call = True
    if records.in_number_records:
        if weight != 1.0:
            numbers.weight_at.append(len(numbers.values))
            numbers.weights.append(weight)
        numbers.values.append(value)
        numbers.rows.append(records.row)
    else:
        records.values.append(value)
        records.weights.append(weight)


def _check_size(records: MetricRecords, name: str, size: int, shape: tuple[int, ...]) -> None:
    """A call's size against its kind's rule (``MetricRecords.checks_call_size``): a multiple of its
    ``parts``, one element for a kind that ``keeps_latest``."""
    kind = records.kind
    if size % kind.parts:
        raise TypeError(
            f"metric {name!r} (kind {kind.name!r}) splits each call into {kind.parts} equal "
            f"parts, so a call must hold a multiple of {kind.parts} elements; got {size}"
        )
    if size != 1 and kind.keeps_latest:
        raise ValueError(
            f"metric {name!r} (kind {kind.name!r}) takes one value, got shape {tuple(shape)}"
        )


class Prepared(NamedTuple):
    """One log call's value and weight, checked once (``prepare``); it may be recorded
    into several metrics (``Tracker.log_shared``)."""

    number: float | None  # a python number with a python weight: the number path
    weight_number: float
    value: np.ndarray | Tensor | float | None  # as logged (a host copy for arrays)
    weight: np.ndarray | Tensor | float | None
    size: int  # elements
    shape: tuple[int, ...]  # of the value as logged, for messages
    check_weights: bool  # weights are an array that is not a bool mask
    # where the fold runs: None for the host, else the device or a tensor on it (its
    # device is read only for a metric that has none yet)
    device: torch.device | Tensor | None
    versions: tuple[Any, ...]  # each tensor recorded by reference, then its version


_new_tuple = tuple.__new__  # a Prepared from a plain tuple of its fields
TENSOR_WEIGHTS = frozenset({Tensor, float, int})
"""The weight types ``record_tensor`` takes with a plain tensor value (and None)."""
NUMBER_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})
"""The dtypes of a 0-d CPU tensor that a host fold's log call records as a python
number, exactly (``tolist`` gives a float), the way a python float is recorded."""
_SCRATCH_KIND = Mean()  # the kind of the record store ``prepare`` checks a tensor into


def prepare(
    name: str,
    value: Any,
    weight: Any,
    *,
    reduce_host_data_with_numpy: bool,
    copy: bool,
    checked: CheckedWeight | None = None,
) -> Prepared:
    """Check a value (number, array, tensor) and its weight without reading device
    tensor data; ``copy``: a CPU tensor is recorded as a copy (``host_copy``);
    ``checked``: the tracker's last checked tensor weight (``CheckedWeight``). A plain
    tensor with no weight, a plain tensor weight or a python one is ``record_tensor``'s.

    Raises:
        TypeError, ValueError: naming ``name`` and what is wrong.
    """
    if type(value) is Tensor and (weight is None or type(weight) in TENSOR_WEIGHTS):
        scratch = MetricRecords(_SCRATCH_KIND, None, -1)
        size = record_tensor(
            scratch,
            name,
            value,
            weight,
            reduce_host_data_with_numpy,
            copy,
            checked or CheckedWeight(),
            "propagate",
        )
        return _new_tuple(
            Prepared,
            (
                None,
                1.0,
                as_array(scratch.values[0]),
                as_array(scratch.weights[0]),
                size,
                tuple(value.shape),
                scratch.num_deferred_checks > 0,
                scratch.record_device,
                tuple(scratch.versions),
            ),
        )
    if isinstance(value, MaskedArray) or isinstance(weight, MaskedArray):
        value, weight = unmask(name, value, weight)
    weight_tensor = isinstance(weight, Tensor)
    value_tensor = isinstance(value, Tensor)
    if value_tensor:
        value = check_tensor(name, value)
        shape, size = tuple(value.shape), value.numel()
        if copy and value.is_cpu:
            value = host_copy(value)
    else:
        number = as_number(name, value)
        if number is not None:
            # a tensor is never a number (0-d ones included: reading one would sync)
            if weight is None:
                return _new_tuple(Prepared, (number, 1.0, None, None, 1, (), False, None, ()))
            if not weight_tensor:
                weight_number = as_number(name, weight, "weight")
                if weight_number is not None:
                    return _new_tuple(
                        Prepared, (number, weight_number, None, None, 1, (), False, None, ())
                    )
            value = np.array(number)
        else:
            value = numeric_array(name, value)
        shape, size = value.shape, value.size
    check = False
    if weight is not None:
        weight, check = _weight(name, weight, shape, weight_tensor, copy)
    device = None
    if (value_tensor or weight_tensor or not reduce_host_data_with_numpy) and not (
        reduce_host_data_with_numpy and _on_host(value) and _on_host(weight)
    ):
        tensor = value if isinstance(value, Tensor) else weight  # a 0-d copy is an array
        device = tensor.device if isinstance(tensor, Tensor) else CPU
    versions = tuple(v for x in (weight, value) if isinstance(x, Tensor) for v in (x, x._version))
    return _new_tuple(Prepared, (None, 1.0, value, weight, size, shape, check, device, versions))


def _weight(
    name: str, weight: Any, shape: tuple[int, ...], is_tensor: bool, copy: bool
) -> tuple[Any, bool]:
    """A weight as recorded (a number, a host copy or a tensor; ``copy``: a CPU tensor
    as a copy) and whether its data needs checking (an array that is not a bool mask)."""
    if is_tensor:
        weight = check_tensor(name, weight, "weight")
        check = weight.dtype is not BOOL
        if copy and weight.is_cpu:
            weight = host_copy(weight)
    else:
        number = as_number(name, weight, "weight")
        if number is not None:
            check_weight_number(name, number)
            return number, False
        check = not (isinstance(weight, np.ndarray) and weight.dtype.kind == "b")
        weight = numeric_array(name, weight, "weight")
    if tuple(weight.shape) != shape:
        raise ValueError(
            f"metric {name!r}: weight shape {tuple(weight.shape)} does not match "
            f"value shape {shape}"
        )
    return weight, check


def _on_host(value: Any) -> bool:
    """Whether ``value`` is not a tensor or is a plain CPU tensor (subclasses, like
    device tensors, take the device path)."""
    return not isinstance(value, Tensor) or (type(value) is Tensor and value.is_cpu)


class CheckedWeight:
    """The last tensor weight a tracker's log calls checked, and what the checks found.

    RL losses pass one response mask to many metrics of a micro-batch. A weight logged
    again unchanged needs none of its checks again, only the comparison of its shape
    with the value's. Unchanged is the same object at the same version, dtype and shape.
    Every in-place operation bumps a tensor's version, metadata ones such as ``resize_``
    and ``set_`` included. But ``weight.data = other`` gives it another dtype, shape and
    data without one. The dtype and shape are all the checks read; the data is read at
    the fold.

    ``last`` holds the weight as logged, its version, dtype, shape and size, its device
    (None on the CPU) and whether its data is checked at the fold; or ``NOT_CHECKED``.
    It keeps the weight alive until the tracker's next fold or reset.
    """

    NOT_CHECKED = (None, -1, None, None, 0, None, False)

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: tuple[Any, ...] = self.NOT_CHECKED

    def clear(self) -> None:
        self.last = self.NOT_CHECKED


def record_tensor(
    records: MetricRecords,
    name: str,
    value: Tensor,
    weight: Tensor | float | int | None,
    host: bool,
    copy: bool,
    checked: CheckedWeight,
    nonfinite: str,
) -> int:
    """Check and record a plain tensor into ``records`` (the metric called ``name``).

    Every tensor log call comes here, ``prepare``'s too (into a scratch
    ``MetricRecords``), but for the 0-d CPU float tensors ``Tracker._log`` records as
    numbers (``NUMBER_DTYPES``). The weight is None, a plain tensor or a python float or
    int. Returns the elements recorded. Nothing is recorded when a check fails.

    The path of a weight logged again unchanged, and of a value recorded by reference,
    is written out here: the log call's hot path. A new weight's checks
    (``_check_weight``), a host fold's copy into the metric's arenas
    (``CopyArena.copy``) and any other copy (``_copy_value``, ``_weight_copy``) are
    functions of their own. The call's size is checked before any copy is written, so
    an arena holds only recorded calls' copies.

    The value's checks are ``inputs.check_tensor``'s, with each attribute read once
    and only when needed. A strided nested tensor has no shape: reading it tells one (a
    jagged one has a layout of its own). A CPU tensor is not a meta one. A plain tensor
    has no dispatch of its own. A refused tensor gets ``tensor_error``'s message.
    ``_check_weight`` makes the same checks of a weight: written out in both, they cost
    no call (log_bench).

    Args:
        host: CPU tensors take the host path.
        copy: CPU tensors are recorded as copies (``Tracker.copy_cpu_tensors``).
        checked: the tracker's last checked tensor weight.
        nonfinite: the tracker's policy; "error" checks the values at the fold.
    """
    if value.dtype not in REAL_DTYPES or value.layout is not STRIDED:
        raise tensor_error(name, value)
    try:
        shape = value.shape  # a strided nested tensor has none: this read checks that too
    except RuntimeError:
        if not value.is_nested:
            raise
        raise tensor_error(name, value) from None
    cpu = value.is_cpu
    if not cpu and value.is_meta:
        raise tensor_error(name, value)
    on_host = host and cpu  # else the fold runs on the value's device
    device: torch.device | Tensor | None
    if type(weight) is Tensor:
        try:
            version = weight._version
        except RuntimeError:  # an inference tensor: a copy, new each call, checked anew
            weight = tracked(weight)
            version = weight._version
        last = checked.last
        if not (
            weight is last[0]
            and version == last[1]
            and weight.dtype is last[2]
            and weight.shape == last[3]
        ):  # not logged again unchanged: its checks
            last = _check_weight(name, weight, version, checked)
        _, _, _, weight_shape, size, device, check_data = last
        if check_data and weight.requires_grad:  # a view: the graph is not kept alive
            weight = weight.detach()
        if weight_shape != shape:
            raise ValueError(
                f"metric {name!r}: weight shape {tuple(weight_shape)} does not match "
                f"value shape {tuple(shape)}"
            )
        if records.checks_call_size:  # before a copy is written into the metric's arenas
            _check_size(records, name, size, shape)
        if device is None:
            if copy:  # its values now (its checks may be kept: they read no data)
                copied = None
                if on_host and shape:  # into the metric's arena (made at its first copy)
                    arena = records.weight_copies or records.new_arena("weight")
                    copied = arena.copy(weight, size)
                weight = _weight_copy(weight, shape) if copied is None else copied
                version = None
        elif on_host:  # a CPU value with a device weight: the fold runs there
            on_host = False
        else:
            device = None
    else:
        version = None
        if weight is not None:  # a python float or int
            weight = _weight_number(name, weight)
        check_data, device = False, None
        size = shape.numel()
        if records.checks_call_size:  # before a copy is written into the metric's arenas
            _check_size(records, name, size, shape)
    if not on_host and device is None:
        device = value
    if cpu and copy:
        copied = None
        if on_host and shape:
            copied = (records.value_copies or records.new_arena("value")).copy(value, size)
        if copied is None:
            value, weight = _copy_value(value, weight, shape)
        else:
            value = copied
        value_version = None
    else:  # recorded by reference, detached (a view: the record must not keep the graph)
        if value.requires_grad:
            value = value.detach()
        try:
            value_version = value._version
        except RuntimeError:  # an inference tensor: torch keeps it no version counter
            value, value_version = tracked(value), None
    # each tensor recorded by reference, then its version (one extend a call)
    if version is None:
        versions: tuple[Any, ...] = () if value_version is None else (value, value_version)
    elif value_version is None:
        versions = (weight, version)
    else:
        versions = (weight, version, value, value_version)
    deferred = check_data or nonfinite == "error"
    _append(records, value, weight, deferred, versions, device)
    return size


def _check_weight(
    name: str, weight: Tensor, version: int, checked: CheckedWeight
) -> tuple[Any, ...]:
    """The checks of a tensor weight not logged just before unchanged (``record_tensor``'s
    checks of a value). Returns what they found, kept in ``checked`` while it is
    (``CheckedWeight.last``): its shape, size and device (None on the CPU), and whether its
    data is checked at the fold (a bool mask's is not)."""
    dtype = weight.dtype
    if dtype not in REAL_DTYPES or weight.layout is not STRIDED:
        raise tensor_error(name, weight, "weight")
    try:
        shape = weight.shape
    except RuntimeError:
        if not weight.is_nested:
            raise
        raise tensor_error(name, weight, "weight") from None
    device = None
    if not weight.is_cpu:
        if weight.is_meta:
            raise tensor_error(name, weight, "weight")
        device = weight.device
    check_data = dtype is not BOOL  # a mask's data needs no check
    size = shape.numel()
    checked.last = last = (weight, version, dtype, shape, size, device, check_data)
    return last


def _weight_copy(weight: Tensor, shape: torch.Size) -> Tensor | float:
    """A CPU tensor weight's values now: a clone, which nothing else holds (no version to
    check; detached, as the recorded weight is; never an inference tensor), or for a
    0-d one, its number."""
    if shape:
        return plain_clone(weight) if INFERENCE_MODE() else weight.clone()
    return float(weight.tolist())  # type: ignore[arg-type]  # a 0-d tensor's is a number


def _copy_value(value: Tensor, weight: Any, shape: torch.Size) -> tuple[Any, Any]:
    """A CPU tensor value's copy (``Tracker.copy_cpu_tensors``) that is not a host fold's
    ``CopyArena.copy``, and its weight.

    A 0-d tensor becomes a python float (``tolist`` reads it without a torch operation)
    with a python weight; with a tensor weight, a 0-d array. Any other copy is a clone,
    which nothing else holds (detached; never an inference tensor).
    """
    if not shape:
        if type(weight) is Tensor:  # a device weight: the value is an array
            return host_copy(value), weight
        number = float(value.tolist())  # type: ignore[arg-type]
        return number, 1.0 if weight is None else weight
    if value.requires_grad:
        value = value.detach()
    return (plain_clone(value) if INFERENCE_MODE() else value.clone()), weight


def _append(
    records: MetricRecords,
    value: Any,
    weight: Any,
    deferred: bool,
    versions: tuple[Any, ...],
    device: torch.device | Tensor | None,
) -> None:
    """The end of every log call that records an array or a tensor.

    Appends the value and weight of a call whose size passed its kind's rule
    (``_check_size``). ``deferred``: the call's data is checked at the fold, which may reject it.
    ``versions``: each tensor recorded by reference, then its version. ``device``: where
    the fold runs (a tensor on it), or None for the host.
    """
    if deferred:
        records.num_deferred_checks += 1  # may be rejected: compute() tells
    else:
        records.accepted_a_call = True
    if versions:
        records.versions += versions
    if device is not None and records.record_device is None:
        records.record_device = device.device if isinstance(device, Tensor) else device
    records.arrays = True
    records.in_number_records = False  # the metric's later numbers follow this record
    records.values.append(value)
    records.weights.append(weight)


def _weight_number(name: str, weight: Tensor | float | int) -> float:
    """A python weight of a tensor value, as a checked float."""
    try:
        weight = float(weight)
    except OverflowError:  # an int beyond float64's range: as_number names it
        as_number(name, weight, "weight")
        raise
    check_weight_number(name, weight)
    return weight


def record_prepared(
    records: MetricRecords,
    name: str,
    prepared: Prepared,
    nonfinite: str,
    numbers: NumberRecords,
) -> int:
    """Record a prepared call (a ``Prepared``) into ``records`` (the metric called ``name``);
    returns the elements recorded (0 for a python number, which ``numbers`` takes while
    the metric has no array record this step)."""
    number, weight_number, value, weight, size, shape, check_weights, device, versions = prepared
    if value is None:  # a python number and weight
        record_number(records, name, cast(float, number), weight_number, nonfinite, numbers)
        return 0
    if records.checks_call_size:
        _check_size(records, name, size, shape)
    deferred = check_weights or nonfinite == "error"
    _append(records, value, weight, deferred, versions, device)
    return size
