"""Reward and completion metrics of a GRPO generation batch, logged per completion.

Pure tensor and list code (no TRL import). Each process logs its own completions, so a
logging window's values are exact over every completion scored in it, however many
generation batches, processes and accumulation steps the window spans:

- ``reward``, ``rewards/<func>/mean``: means over completions (a reward function's NaN,
  for "not applicable", is left out of its own mean; ``reward`` leaves out completions
  no function scored).
- ``reward_std``, ``rewards/<func>/std``: sample standard deviations (ddof=1, as TRL's)
  over the same completions, from float64 sums of the values and their squares (scalar
  states, so they ride in the one packed sync instead of adding the gather a ``std``
  kind needs; the relative error of the variance is about 1e-16 x mean^2 / variance,
  far below 1e-6 while |mean| / std < 1e4, as rewards are).
- ``frac_reward_zero_std``: the fraction of completions whose group (or batch, with
  ``scale_rewards="batch"``) has rewards of zero spread; with
  ``multi_objective_aggregation="normalize_then_sum"``, whose generation batch has
  summed normalised rewards of zero spread (the spread TRL's advantages divide by).
- ``completions/*``: means, minima and maxima over completions; ``*_terminated_length``
  over completions that ended with EOS (0 when none did, as TRL reports).

Given ``by`` (one label per completion, the value of a dataset column), the reward keys,
``frac_reward_zero_std`` and ``completions/{mean,min,max}_length``, ``clipped_ratio`` are
also logged per label as ``<key>/<label>``, with the same meaning over that label's
completions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from rlmetrics.tracker import LogTarget

# a std metric's hidden companions: the mean of squares and the number of values
SQUARES_SUFFIX = "/_mean_of_squares"
COUNT_SUFFIX = "/_count"
# each std key's mean key
MEAN_OF_STD = {"reward_std": "reward"}
LENGTH_KEYS = [
    ("completions/mean_length", "mean"),
    ("completions/min_length", "min"),
    ("completions/max_length", "max"),
]
TERMINATED_KEYS = (
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
)


def zero_std_groups(rewards: Tensor, num_generations: int, scale_rewards: str) -> Tensor:
    """Per completion: does its group (its batch, for "batch" scaling) have zero spread?

    ``rewards`` is the whole generation batch (every process's rows) with NaN for
    completions no reward function scored; the spread is the sample std over the rest.
    """
    if scale_rewards == "batch":
        std = _nan_sample_std(rewards.unsqueeze(0)) if rewards.numel() > 1 else torch.zeros(1)
        return torch.isclose(std, torch.zeros_like(std)).expand(rewards.shape[0])
    if num_generations == 1:
        return torch.ones(rewards.shape[0], dtype=torch.bool, device=rewards.device)
    std = _nan_sample_std(rewards.view(-1, num_generations))
    return torch.isclose(std, torch.zeros_like(std)).repeat_interleave(num_generations)


def zero_std_normalized_sum(
    rewards_per_func: Tensor, reward_weights: Tensor, num_generations: int
) -> Tensor:
    """Per completion, under ``multi_objective_aggregation="normalize_then_sum"``: do the
    generation batch's rewards, each function's normalised within its group and then
    summed with the weights, have zero spread? (TRL 1.16's aggregation: a completion no
    function scored is left out; a group of one normalises to its deviation, 0.)

    ``rewards_per_func`` is the whole generation batch (every process's rows), one
    column per reward function, NaN where a function does not apply.
    """
    num_funcs = rewards_per_func.shape[1]
    grouped = rewards_per_func.view(-1, num_generations, num_funcs)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    if num_generations > 1:
        std = _nan_sample_std(grouped.transpose(1, 2)).unsqueeze(1)
    else:
        std = torch.zeros_like(mean)
    normalized = ((grouped - mean) / (std + 1e-4)).view(-1, num_funcs)
    summed = (normalized * reward_weights.to(normalized.device)).nansum(dim=1)
    summed[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    if summed.numel() > 1:
        spread = _nan_sample_std(summed.unsqueeze(0))
    else:
        spread = torch.zeros(1, device=summed.device)
    return torch.isclose(spread, torch.zeros_like(spread)).expand(summed.shape[0])


def _nan_sample_std(rows: Tensor) -> Tensor:
    """Each row's sample std (ddof=1) over its non-NaN entries."""
    valid = ~torch.isnan(rows)
    count = valid.sum(-1)
    values = torch.where(valid, rows, 0.0)
    mean = values.sum(-1, keepdim=True) / count.clamp(min=1).unsqueeze(-1)
    squares = torch.where(valid, (rows - mean) ** 2, 0.0).sum(-1)
    return torch.sqrt(squares / (count - 1))


def log_rewards(
    log: LogTarget,
    *,
    rewards_per_func: Tensor,
    reward_weights: Tensor,
    func_names: Sequence[str],
    is_std_zero: Tensor,
    by: Sequence[str] | None = None,
) -> None:
    """Log this process's completions' rewards (rows of ``rewards_per_func``, NaN where a
    function does not apply) and zero-spread flags; with ``by``, also per label."""
    for i, name in enumerate(func_names):
        _log_mean_and_std(log, f"rewards/{name}", rewards_per_func[:, i], by=by)
    scored = ~torch.isnan(rewards_per_func).all(dim=1)
    weighted = (rewards_per_func * reward_weights.to(rewards_per_func.device)).nansum(dim=1)
    total = torch.where(scored, weighted, torch.nan)
    _log_mean_and_std(log, "reward", total, mean_name="reward", std_name="reward_std", by=by)
    log.mean("frac_reward_zero_std", is_std_zero)
    if by is not None:
        log.mean("frac_reward_zero_std", is_std_zero, by=by)


def _log_mean_and_std(
    log: LogTarget,
    prefix: str,
    values: Tensor,
    *,
    mean_name: str | None = None,
    std_name: str | None = None,
    by: Sequence[str] | None = None,
) -> None:
    valid = ~torch.isnan(values)
    values = torch.where(valid, values, 0.0).double()
    std_name = std_name or f"{prefix}/std"
    for labels in (None, by) if by is not None else (None,):
        log.mean(mean_name or f"{prefix}/mean", values, weight=valid, by=labels)
        log.mean(std_name + SQUARES_SUFFIX, values * values, weight=valid, by=labels)
        log.sum(std_name + COUNT_SUFFIX, valid.double(), by=labels)


def log_completions(
    log: LogTarget,
    *,
    completion_ids: Sequence[Sequence[int]],
    tool_mask: Sequence[Sequence[int]] | None,
    stop_ids: Sequence[int],
    by: Sequence[str] | None = None,
) -> None:
    """Log this process's completion lengths (model tokens only, when a tool mask marks
    tool output) and whether each was truncated (its last token is no EOS or pad); with
    ``by``, the lengths and the truncated fraction also per label."""
    if tool_mask is not None:
        lengths = [float(sum(mask)) for mask in tool_mask]
    else:
        lengths = [float(len(ids)) for ids in completion_ids]
    stops = set(stop_ids)
    truncated = [len(ids) > 0 and ids[-1] not in stops for ids in completion_ids]
    log.log_shared(LENGTH_KEYS, lengths)
    log.mean("completions/clipped_ratio", [float(t) for t in truncated])
    if by is not None:
        log.log_shared(LENGTH_KEYS, lengths, by=by)
        log.mean("completions/clipped_ratio", [float(t) for t in truncated], by=by)
    terminated = [not t for t in truncated]
    if any(terminated):
        log.log_shared(
            list(zip(TERMINATED_KEYS, ("mean", "min", "max"), strict=True)),
            lengths,
            terminated,
        )


def finish_results(results: dict[str, float]) -> dict[str, float]:
    """Turn a computed window into TRL's keys: sample stds from the hidden sums (which
    are dropped; per label too, where ``/<label>`` follows the hidden suffix), and TRL's
    0 for terminated lengths when no completion terminated."""
    out = {key: value for key, value in results.items() if _hidden_part(key) is None}
    for key, count in results.items():
        parts = _hidden_part(key)
        if parts is None or parts[1] != COUNT_SUFFIX:
            continue
        std_key, _, label = parts
        mean_key = MEAN_OF_STD.get(std_key, std_key.removesuffix("/std") + "/mean")
        mean = out.get(mean_key + label)
        squares = results.get(std_key + SQUARES_SUFFIX + label)
        if mean is not None and squares is not None:
            out[std_key + label] = _sample_std(mean, squares, count)
    if "completions/mean_length" in out:
        for key in TERMINATED_KEYS:
            out.setdefault(key, 0.0)
    return out


def _hidden_part(key: str) -> tuple[str, str, str] | None:
    """(std key, hidden suffix, ``/<label>`` or "") of a hidden companion's key, else None."""
    for suffix in (SQUARES_SUFFIX, COUNT_SUFFIX):
        if key.endswith(suffix):
            return key[: -len(suffix)], suffix, ""
        head, found, label = key.partition(suffix + "/")
        if found:
            return head, suffix, "/" + label
    return None


def _sample_std(mean: float, mean_of_squares: float, count: float) -> float:
    """The ddof=1 std of ``count`` values from their mean and mean of squares."""
    if count < 2:
        return math.nan
    variance = max(mean_of_squares - mean * mean, 0.0) * count / (count - 1)
    return math.sqrt(variance)
