"""Counting the torch ops a piece of code dispatches, for the benchmarks' op-count tables.

A ``TorchDispatchMode`` sees every aten op that reaches the dispatcher while it is active
(views and ``detach`` included, factory functions such as ``torch.tensor`` too): on a GPU
each op that computes is a kernel launch, and each one, computing or not, costs a pass
through the dispatcher on the host. numpy and python arithmetic are invisible to it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts the calls of ``__torch_dispatch__`` while active, per op name.

    Example:
        >>> import torch
        >>> x = torch.ones(3)
        >>> with OpCounter() as ops:
        ...     _ = (x + 1).sum()
        >>> ops.total, dict(ops.ops)
        (2, {'aten.add.Tensor': 1, 'aten.sum.default': 1})
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        """Ops dispatched so far."""
        return sum(self.ops.values())


def count_ops(call: Callable[[], Any], repeat: int = 1) -> OpCounter:
    """Run ``call`` ``repeat`` times under a fresh counter and return the counter."""
    with OpCounter() as counter:
        for _ in range(repeat):
            call()
    return counter


def describe(counter: OpCounter, per: int = 1) -> str:
    """``"aten.sum.default x2, ..."``: each op's count divided by ``per``, most first."""
    return ", ".join(f"{name} x{n / per:g}" for name, n in counter.ops.most_common()) or "none"
