"""Each logged metric recomputed with numpy over the whole step, from the per-token
values a run recorded (every micro-batch of every process): the independent reference
ExactGRPOTrainer's logs must equal, whatever the split."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

MAX_COMPLETION_LENGTH = 8  # grpo_runs.make_config's


def _rows(items: list[dict[str, Any]], key: str) -> np.ndarray:
    """Concatenate one captured field over micro-batches, padding the token axis."""
    arrays = [item[key] for item in items]
    if arrays[0].ndim == 1:
        return np.concatenate(arrays)
    width = max(a.shape[1] for a in arrays)
    return np.concatenate([np.pad(a, ((0, 0), (0, width - a.shape[1]))) for a in arrays])


def policy_metrics(items: list[dict[str, Any]], options: dict[str, Any]) -> dict[str, float]:
    """entropy, kl, clip ratios and loss of one window from its micro-batch captures."""
    mask = _rows(items, "completion_mask")
    logp, entropy = _rows(items, "logp"), _rows(items, "entropy")
    old = _rows(items, "old_per_token_logps") if "old_per_token_logps" in items[0] else logp
    adv = _rows(items, "advantages")[:, None]
    tokens = mask.sum()
    ratio = np.exp(logp - old)  # (B, T), or (B, 1) with sequence-level sampling
    if options.get("importance_sampling_level") == "sequence":
        ratio = np.exp(((logp - old) * mask).sum(1) / np.maximum(mask.sum(1), 1))[:, None]
    out = {"entropy": (entropy * mask).sum() / tokens}
    beta = options.get("beta", 0.0)
    kl = np.zeros_like(logp)
    if beta:
        diff = _rows(items, "ref") - logp
        kl = np.exp(diff) - diff - 1
        if options.get("use_bias_correction_kl", True):  # GRPOConfig's default
            kl = kl * ratio
        out["kl"] = (kl * mask).sum() / tokens
    out.update(clip_metrics(ratio, adv, mask, options.get("epsilon", 0.2)))
    eps = options.get("epsilon", 0.2)
    capped = np.minimum(ratio, options["delta"]) if options.get("delta") else ratio
    surrogate = -np.minimum(capped * adv, np.clip(ratio, 1 - eps, 1 + eps) * adv) + beta * kl
    out["loss"] = loss(surrogate * mask, mask, items, options.get("loss_type", "dapo"))
    return out


def clip_metrics(ratio: np.ndarray, adv: np.ndarray, mask: np.ndarray, eps: float) -> dict:
    """Clipped fractions: of tokens, or of sequences when there is one ratio per
    sequence; the min/max keys over sequences."""
    low = (ratio < 1 - eps) & (adv < 0)
    high = (ratio > 1 + eps) & (adv > 0)
    if ratio.shape[1] == 1:
        low, high = low[:, 0].astype(float), high[:, 0].astype(float)
        return {
            "clip_ratio/low_mean": low.mean(),
            "clip_ratio/high_mean": high.mean(),
            "clip_ratio/region_mean": np.maximum(low, high).mean(),
            "clip_ratio/low_min": low.min(),
            "clip_ratio/high_max": high.max(),
        }
    tokens, per_seq = mask.sum(), mask.sum(1)
    has = per_seq > 0
    return {
        "clip_ratio/low_mean": (low * mask).sum() / tokens,
        "clip_ratio/high_mean": (high * mask).sum() / tokens,
        "clip_ratio/region_mean": ((low | high) * mask).sum() / tokens,
        "clip_ratio/low_min": ((low * mask).sum(1)[has] / per_seq[has]).min(),
        "clip_ratio/high_max": ((high * mask).sum(1)[has] / per_seq[has]).max(),
    }


def loss(masked: np.ndarray, mask: np.ndarray, items: list[dict], loss_type: str) -> float:
    """The logged loss: what each loss type averages, over the window."""
    per_seq = mask.sum(1)
    if loss_type == "dapo":
        return masked.sum() / mask.sum()
    if loss_type == "grpo":
        return (masked.sum(1) / np.maximum(per_seq, 1)).mean()
    if loss_type == "dr_grpo":
        return (masked.sum(1) / MAX_COMPLETION_LENGTH).mean()
    # bnpo: the mean, over micro-batches, of each one's token mean
    rows = np.cumsum([0] + [len(item["completion_mask"]) for item in items])
    return np.mean(
        [masked[a:b].sum() / max(mask[a:b].sum(), 1) for a, b in itertools.pairwise(rows)]
    )


def _sample_std(values: np.ndarray) -> float:
    return float(np.std(values, ddof=1)) if values.size > 1 else float("nan")


def reward_metrics(rewards: np.ndarray, num_generations: int) -> dict[str, float]:
    """Reward keys from the whole generation batch's rewards (rows, one column per
    reward function; NaN where a function does not apply)."""
    out: dict[str, float] = {}
    for i, name in enumerate(("reward_vowels", "reward_short")):
        column = rewards[:, i][~np.isnan(rewards[:, i])]
        out[f"rewards/{name}/mean"] = column.mean()
        out[f"rewards/{name}/std"] = _sample_std(column)
    scored = ~np.isnan(rewards).all(1)
    total = np.nansum(rewards, axis=1)[scored]
    out["reward"] = total.mean()
    out["reward_std"] = _sample_std(total)
    groups = np.where(scored, np.nansum(rewards, axis=1), np.nan).reshape(-1, num_generations)
    stds = np.array([_sample_std(g[~np.isnan(g)]) for g in groups])
    out["frac_reward_zero_std"] = np.isclose(stds, 0.0).mean()
    return out


def completion_metrics(lengths: np.ndarray, truncated: np.ndarray) -> dict[str, float]:
    out = {
        "completions/mean_length": lengths.mean(),
        "completions/min_length": lengths.min(),
        "completions/max_length": lengths.max(),
        "completions/clipped_ratio": truncated.mean(),
    }
    done = lengths[~truncated]
    for stat in ("mean", "min", "max"):
        value = getattr(np, stat)(done) if done.size else 0.0
        out[f"completions/{stat}_terminated_length"] = value
    return out


def expected(per_rank: list[list[dict[str, Any]]], step: int, spec: dict[str, Any]) -> dict:
    """Every metric of the logging window that ends at ``step`` (its last
    ``logging_steps`` optimizer steps) from all processes' captures."""
    options = spec["options"]
    window = range(step - spec.get("logging_steps", 1) + 1, step + 1)
    items = [item for captures in per_rank for item in captures if item["step"] in window]
    micro = [item for item in items if "logp" in item]
    out = policy_metrics(micro, options)
    first = [item for item in per_rank[0] if item["step"] in window]
    rewards = [item["rewards"] for item in first if "rewards" in item]
    if rewards:  # generation steps: rewards are gathered, so rank 0's are all of them
        all_rewards = np.concatenate(rewards)
        out.update(reward_metrics(all_rewards, options.get("num_generations", 4)))
        gen = [item for item in items if "lengths" in item]
        lengths = np.concatenate([item["lengths"] for item in gen])
        truncated = np.concatenate([item["truncated"] for item in gen]).astype(bool)
        out.update(completion_metrics(lengths, truncated))
        out["vowel_reward/mean_words"] = lengths_in_words(gen)
    return out


def lengths_in_words(gen: list[dict[str, Any]]) -> float:
    """``reward_vowels``'s log_metric: one call per process and generation batch, each
    the mean number of words of its completions; logged: the mean over calls."""
    return float(np.mean([item["words"].mean() for item in gen]))


POLICY_KEYS_BY_SOURCE = (
    "entropy",
    "kl",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)
COMPLETION_KEYS_BY_SOURCE = (
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
)


def expected_by_source(
    per_rank: list[list[dict[str, Any]]], step: int, spec: dict[str, Any], source_of: Any
) -> dict[str, float]:
    """``<key>/<source>`` for every source of the window: each metric over that
    source's completions only. A micro-batch row's source comes from its prompt tokens
    (``source_of(prompt_ids row)``), a generation's from its prompt text."""
    options = spec["options"]
    window = range(step - spec.get("logging_steps", 1) + 1, step + 1)
    items = [item for captures in per_rank for item in captures if item["step"] in window]
    micro = [item for item in items if "logp" in item]
    sources = np.concatenate([[source_of(row) for row in item["prompt_ids"]] for item in micro])
    fields = ("completion_mask", "logp", "entropy", "advantages", "old_per_token_logps", "ref")
    whole = {key: _rows(micro, key) for key in fields if key in micro[0]}
    out: dict[str, float] = {}
    for source in np.unique(sources):
        rows = sources == source
        metrics = policy_metrics([{k: v[rows] for k, v in whole.items()}], options)
        keys = [key for key in POLICY_KEYS_BY_SOURCE if key in metrics]  # kl: beta > 0
        out.update({f"{key}/{source}": metrics[key] for key in keys})
    rewards = [item for captures in per_rank for item in captures if "rewards" in item]
    rewards = [item for item in rewards if item["step"] in window]
    if rewards:
        out.update(_rewards_by_source(per_rank, window, options.get("num_generations", 4)))
        gen = [item for item in items if "lengths" in item]
        lengths = np.concatenate([item["lengths"] for item in gen])
        truncated = np.concatenate([item["truncated"] for item in gen]).astype(bool)
        gen_sources = np.concatenate([item["sources"] for item in gen])
        for source in np.unique(gen_sources):
            rows = gen_sources == source
            metrics = completion_metrics(lengths[rows], truncated[rows])
            out.update({f"{key}/{source}": metrics[key] for key in COMPLETION_KEYS_BY_SOURCE})
    return out


def _rewards_by_source(
    per_rank: list[list[dict[str, Any]]], window: range, num_generations: int
) -> dict[str, float]:
    """Reward keys per source. Every process captured the gathered rewards (all
    processes' rows, in process order) and its own rows' sources: the sources of the
    gathered rows are the processes' sources concatenated in process order."""
    out: dict[str, float] = {}
    first = [item for item in per_rank[0] if "rewards" in item and item["step"] in window]
    for batch, rewards in enumerate(item["rewards"] for item in first):
        local = [
            [item for item in captures if "rewards" in item and item["step"] in window][batch]
            for captures in per_rank
        ]
        sources = np.concatenate([item["reward_sources"] for item in local])
        assert len(sources) == len(rewards)
        zero_std = _zero_std_per_completion(rewards, num_generations)
        for source in np.unique(sources):
            rows = sources == source
            metrics = reward_metrics(rewards[rows], num_generations=1)
            metrics["frac_reward_zero_std"] = zero_std[rows].mean()
            out.update({f"{key}/{source}": value for key, value in metrics.items()})
    if len(first) > 1:
        raise NotImplementedError("per-source rewards over several generation batches")
    return out


def _zero_std_per_completion(rewards: np.ndarray, num_generations: int) -> np.ndarray:
    """Per completion: does its group's total reward have zero sample spread?"""
    scored = ~np.isnan(rewards).all(1)
    totals = np.where(scored, np.nansum(rewards, axis=1), np.nan).reshape(-1, num_generations)
    stds = np.array([_sample_std(group[~np.isnan(group)]) for group in totals])
    return np.repeat(np.isclose(stds, 0.0), num_generations)


def token_values(per_rank: list[list[dict[str, Any]]], step: int, spec: dict) -> dict:
    """The window's per-token entropy, importance ratio and KL (beta > 0) over every
    completion token of every process (one ratio per sequence when it is per sequence)."""
    options = spec["options"]
    window = range(step - spec.get("logging_steps", 1) + 1, step + 1)
    micro = [item for captures in per_rank for item in captures if item["step"] in window]
    micro = [item for item in micro if "logp" in item]
    mask = _rows(micro, "completion_mask").astype(bool)
    logp = _rows(micro, "logp")
    old = _rows(micro, "old_per_token_logps") if "old_per_token_logps" in micro[0] else logp
    out = {"entropy": _rows(micro, "entropy")[mask]}
    ratio = np.exp(logp - old)
    if options.get("importance_sampling_level") == "sequence":
        seq = np.exp(((logp - old) * mask).sum(1) / np.maximum(mask.sum(1), 1))
        out["importance_ratio"] = seq
    else:
        out["importance_ratio"] = ratio[mask]
    if options.get("beta", 0.0):
        diff = _rows(micro, "ref") - logp
        kl = np.exp(diff) - diff - 1
        if options.get("use_bias_correction_kl", True):
            kl = kl * ratio
        out["kl"] = kl[mask]
    return out
