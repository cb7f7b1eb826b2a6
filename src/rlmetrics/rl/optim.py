"""Per-optimizer-step metrics: gradient norm and learning rate."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from rlmetrics.rl.updates import MetricUpdate


def grad_norm_updates(
    grad_norm: float | Tensor, name: str = "actor/grad_norm"
) -> list[MetricUpdate]:
    """``name`` (mean over the step's optimizer steps) and ``name_max`` (their max).

    Log once per optimizer step, on every rank, the total norm that
    ``clip_grad_norm_`` returns (the same on all ranks after the gradient reduction):
    weight 1 per step and rank, so the merged mean is the mean over optimizer steps.
    """
    if isinstance(grad_norm, Tensor):
        grad_norm = grad_norm.detach()
    return [MetricUpdate(name, "mean", grad_norm), MetricUpdate(f"{name}_max", "max", grad_norm)]


def current_lr(source: Any) -> float:
    """The lr of an optimizer's first param group, a scheduler's last lr, or a number."""
    if isinstance(source, int | float):
        return float(source)
    if hasattr(source, "param_groups"):
        return float(source.param_groups[0]["lr"])
    if hasattr(source, "get_last_lr"):
        return float(source.get_last_lr()[0])
    raise TypeError(
        f"lr_update expects an optimizer, an lr scheduler or a number, got {type(source).__name__}"
    )


def lr_update(source: Any, name: str = "actor/lr") -> MetricUpdate:
    """``name`` (kind ``last``): the lr the optimizer step about to run will use.

    Call it before ``scheduler.step()`` (with the optimizer, or the scheduler before it
    steps): afterwards the optimizer holds the next step's lr.
    """
    return MetricUpdate(name, "last", current_lr(source))
