"""Each logged metric recomputed with numpy over the whole step, from the per-token
values a run recorded (every micro-batch of every process): the independent reference
ExactGRPOTrainer's logs must equal, whatever the split."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

MAX_COMPLETION_LENGTH = 8  # grpo_runs.make_config's
# keys whose value is not a function of the batch (wall time, the epoch counter)
NOT_BATCH = {"step_time", "epoch", "step"}
TOL = 1e-6


def logged(result: list[dict]) -> list[dict[str, float]]:
    """The logged metrics of a run (every process logs the same dicts; rank 0's)."""
    return [{k: v for k, v in entry.items() if k not in NOT_BATCH} for entry in result[0]["logs"]]


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=TOL, abs_tol=TOL) or (math.isnan(a) and math.isnan(b))


def spread(runs: dict, trainer: str, splits: list[tuple[int, int]]) -> dict[tuple, float]:
    """Per (step, key): the largest difference between splits."""
    logs = [logged(runs[trainer, f"{p}x{a}"]) for p, a in splits]
    out = {}
    for step, entries in enumerate(zip(*logs, strict=True), start=1):
        assert all(set(e) == set(entries[0]) for e in entries), "splits logged different keys"
        for key in entries[0]:
            values = [e[key] for e in entries]
            out[step, key] = max(values) - min(values)
    return out


def mismatches(entry: dict[str, float], want: dict[str, float]) -> dict[str, tuple]:
    """The reference's keys that a log entry lacks or logs another value for:
    key -> (logged, numpy)."""
    return {
        k: (entry.get(k), v) for k, v in want.items() if k not in entry or not close(entry[k], v)
    }


def _rows(items: list[dict[str, Any]], key: str) -> np.ndarray:
    """Concatenate one captured field over micro-batches, padding the token axis."""
    arrays = [item[key] for item in items]
    if arrays[0].ndim == 1:
        return np.concatenate(arrays)
    width = max(a.shape[1] for a in arrays)
    return np.concatenate([np.pad(a, ((0, 0), (0, width - a.shape[1]))) for a in arrays])


CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def policy_metrics(items: list[dict[str, Any]], options: dict[str, Any]) -> dict[str, float]:
    """entropy, kl, the loss type's own metrics and ``policy_loss`` of one window from
    its micro-batch captures (each with its ``keep`` mask when a loss mask is on)."""
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
    loss_type = options.get("loss_type", "dapo")
    eps_low = options.get("epsilon", 0.2)
    eps_high = options.get("epsilon_high") or eps_low
    capped = np.minimum(ratio, options["delta"]) if options.get("delta") else ratio
    if loss_type in CLIPPED_LOSS_TYPES:
        out.update(clip_metrics(capped, adv, mask, eps_low, eps_high))
    if loss_type == "cispo":
        capped_tokens = ((ratio > eps_high) & (adv > 0)).astype(float)
        if ratio.shape[1] == 1:
            out["cispo_clip_ratio"] = capped_tokens.mean()
        else:
            out["cispo_clip_ratio"] = (capped_tokens * mask).sum() / tokens
        surrogate = -np.minimum(ratio, eps_high) * adv * logp
    elif loss_type == "sapo":
        temperature = np.where(adv > 0, 1.0, 1.05)  # GRPOConfig's defaults
        surrogate = -(4 / temperature) / (1 + np.exp(-temperature * (ratio - 1))) * adv
    elif loss_type == "vespo":
        phi = gamma_weights(logp - old, adv, mask)
        out["vespo/phi_seq_mean"] = phi.mean()
        surrogate = -phi * adv * logp
    else:
        clipped = np.clip(ratio, 1 - eps_low, 1 + eps_high)
        surrogate = -np.minimum(capped * adv, clipped * adv)
    if "keep" in items[0]:
        surrogate = surrogate * _rows(items, "keep")
    surrogate = surrogate + beta * kl
    out["policy_loss"] = loss(surrogate * mask, mask, items, loss_type)
    return out


def gamma_weights(log_ratio: np.ndarray, adv: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """VESPO's weight per sequence (GRPOConfig's default k and lambda): phi(w) = exp(lambda)
    w^k exp(-lambda w), w the exp of the sequence's summed log ratio, in log space."""
    low = np.log(1e-8)
    log_w = np.clip((np.clip(log_ratio, -20, 20) * mask).sum(1, keepdims=True), low, 20)
    k = np.where(adv >= 0, 2.0, 3.0)
    lam = np.where(adv >= 0, 3.0, 2.0)
    return np.exp(lam + k * log_w - lam * np.exp(log_w))


def off_policy_keep(item: dict[str, Any], threshold: float) -> np.ndarray:
    """Which sequences of a micro-batch the off-policy mask keeps (as a 0/1 column): a
    non-negative advantage, or a mean per-token log ratio (old over current) at most
    ``threshold``."""
    mask = item["completion_mask"]
    old = item.get("old_per_token_logps", item["logp"])
    mean_kl = ((old - item["logp"]) * mask).sum(1) / np.maximum(mask.sum(1), 1)
    return ((item["advantages"] >= 0) | (mean_kl <= threshold)).astype(float)[:, None]


def high_entropy_keep(batch: list[dict[str, Any]], quantile: float) -> list[np.ndarray]:
    """The tokens of the k-th micro-batch of every rank (``batch``, one per rank) whose
    entropy reaches the (1 - quantile) quantile of those micro-batches' completion
    tokens' entropies, in float32 as TRL computes it."""
    tokens = [b["entropy"][b["completion_mask"].astype(bool)] for b in batch]
    threshold = np.quantile(np.concatenate(tokens).astype(np.float32), 1 - quantile)
    keeps = []
    for b in batch:
        masked = (b["entropy"] * b["completion_mask"]).astype(np.float32)
        keeps.append(((masked >= threshold) & b["completion_mask"].astype(bool)).astype(float))
    return keeps


def entropy_coefficients(
    micro_by_step: dict[int, list[dict[str, Any]]], options: dict[str, Any]
) -> tuple[dict[int, float], dict[int, float]]:
    """Per step: the entropy coefficient the step's bonus applied, and the coefficient
    after the step. Adaptive control moves it by the step's entropy over the bonus's
    tokens on every rank, and applies it only while the last step's entropy was at most
    the target; otherwise it is fixed."""
    coef, last = options.get("entropy_coef", 0.0), np.inf
    target, delta = options.get("entropy_target", 0.2), options.get("entropy_coef_delta", 0.005)
    applied, after = {}, {}
    for step in sorted(micro_by_step):
        if not options.get("use_adaptive_entropy"):
            applied[step] = after[step] = coef
            continue
        applied[step] = coef if last <= target else 0.0
        micro = micro_by_step[step]
        total = sum((item["entropy"] * bonus_tokens(item)).sum() for item in micro)
        world = total / max(sum(bonus_tokens(item).sum() for item in micro), 1.0)
        if world <= target:
            coef = min(coef + delta, options.get("entropy_coef_max", 1.0))
        else:
            coef = max(coef - delta, options.get("entropy_coef_min", 0.0))
        last = world
        after[step] = coef
    return applied, after


def bonus_tokens(item: dict[str, Any]) -> np.ndarray:
    """The tokens the entropy bonus acts on: the completion's, less those the entropy
    mask drops."""
    keep = item.get("entropy_keep")
    return item["completion_mask"] if keep is None else item["completion_mask"] * keep


def clip_metrics(
    ratio: np.ndarray, adv: np.ndarray, mask: np.ndarray, eps: float, eps_high: float | None = None
) -> dict:
    """Clipped fractions: of tokens, or of sequences when there is one ratio per
    sequence; the min/max keys over sequences."""
    eps_high = eps if eps_high is None else eps_high
    low = (ratio < 1 - eps) & (adv < 0)
    high = (ratio > 1 + eps_high) & (adv > 0)
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
    if loss_type in ("dapo", "cispo", "vespo"):
        return masked.sum() / mask.sum()
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(1) / np.maximum(per_seq, 1)).mean()
    if loss_type == "dr_grpo":
        return (masked.sum(1) / MAX_COMPLETION_LENGTH).mean()
    if loss_type == "luspo":
        return masked.sum(1).mean()
    # bnpo: the mean, over micro-batches, of each one's token mean
    rows = np.cumsum([0] + [len(item["completion_mask"]) for item in items])
    return np.mean(
        [masked[a:b].sum() / max(mask[a:b].sum(), 1) for a, b in itertools.pairwise(rows)]
    )


def _sample_std(values: np.ndarray) -> float:
    return float(np.std(values, ddof=1)) if values.size > 1 else float("nan")


def reward_metrics(
    rewards: np.ndarray, num_generations: int, zero_std: np.ndarray | None = None
) -> dict[str, float]:
    """Reward keys from the whole generation batch's rewards (rows, one column per
    reward function; NaN where a function does not apply); ``zero_std``, per row, when
    its zero-spread flag is not its group's (``normalize_then_sum``)."""
    out: dict[str, float] = {}
    for i, name in enumerate(("reward_vowels", "reward_short")):
        column = rewards[:, i][~np.isnan(rewards[:, i])]
        out[f"rewards/{name}/mean"] = column.mean()
        out[f"rewards/{name}/std"] = _sample_std(column)
    scored = ~np.isnan(rewards).all(1)
    total = np.nansum(rewards, axis=1)[scored]
    out["reward"] = total.mean()
    out["reward_std"] = _sample_std(total)
    if zero_std is None:
        zero_std = _zero_std_per_completion(rewards, num_generations)
    out["frac_reward_zero_std"] = zero_std.mean()
    return out


def zero_std_normalized_sum(rewards: np.ndarray, num_generations: int) -> np.ndarray:
    """Per row of one generation batch, under ``normalize_then_sum``: each function's
    rewards normalised within their group (sample std, + 1e-4), summed (weights 1);
    is the batch's spread of those sums zero? One flag for the whole batch."""
    out = np.zeros_like(rewards)
    for start in range(0, len(rewards), num_generations):
        group = rewards[start : start + num_generations]
        for i in range(rewards.shape[1]):
            values = group[:, i]
            valid = values[~np.isnan(values)]  # none: the column stays NaN, as in TRL
            mean = valid.mean() if valid.size else np.nan
            out[start : start + num_generations, i] = (values - mean) / (_sample_std(valid) + 1e-4)
    summed = np.nansum(out, axis=1)[~np.isnan(rewards).all(1)]
    return np.full(len(rewards), np.isclose(_sample_std(summed), 0.0))


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


# Qwen3MoeConfig's router_aux_loss_coef, which the tests' MoE model keeps
MOE_AUX_LOSS_COEF = 0.001


def with_loss_masks(per_rank: list[list[dict[str, Any]]], options: dict) -> list[list[dict]]:
    """Each rank's micro-batch captures, each with ``keep`` (the tokens its loss keeps)
    and ``entropy_keep`` (the high-entropy mask) where those masks are on."""
    micro_by_rank = [[dict(item) for item in c if "logp" in item] for c in per_rank]
    threshold = options.get("off_policy_mask_threshold")
    quantile = options.get("top_entropy_quantile", 1.0)
    for batch in zip(*micro_by_rank, strict=True):  # the k-th micro-batch of every rank
        keeps = [np.ones_like(item["completion_mask"]) for item in batch]
        if threshold is not None:
            keeps = [k * off_policy_keep(i, threshold) for k, i in zip(keeps, batch, strict=True)]
        if quantile < 1.0:
            for item, entropy_keep in zip(batch, high_entropy_keep(batch, quantile), strict=True):
                item["entropy_keep"] = entropy_keep
            keeps = [k * i["entropy_keep"] for k, i in zip(keeps, batch, strict=True)]
        if threshold is not None or quantile < 1.0:
            for item, keep in zip(batch, keeps, strict=True):
                item["keep"] = keep
    return micro_by_rank


def loss_terms(
    micro_by_rank: list[list[dict[str, Any]]], window: range, spec: dict, policy_loss: float
) -> dict[str, float]:
    """``loss`` from the window's policy loss and the terms added per micro-batch (the
    entropy bonus, the MoE load-balancing loss, each a mean over micro-batches), with
    ``policy_loss``, ``entropy_coef`` and ``aux_loss`` where TRL logs them."""
    options = spec["options"]
    micro = [item for items in micro_by_rank for item in items if item["step"] in window]
    out, loss = {}, policy_loss
    if options.get("entropy_coef", 0.0) or options.get("use_adaptive_entropy"):
        by_step: dict[int, list] = {}
        for item in (item for items in micro_by_rank for item in items):
            by_step.setdefault(item["step"], []).append(item)
        applied, after = entropy_coefficients(by_step, options)
        bonus = [
            applied[item["step"]]
            * (item["entropy"] * bonus_tokens(item)).sum()
            / max(bonus_tokens(item).sum(), 1.0)
            for item in micro
        ]
        out["policy_loss"] = policy_loss
        out["entropy_coef"] = after[window[-1]]
        loss -= np.mean(bonus)
    if "aux" in micro[0]:
        out["aux_loss"] = float(np.mean([item["aux"] for item in micro]))
        loss += options.get("router_aux_loss_coef", MOE_AUX_LOSS_COEF) * out["aux_loss"]
    out["loss"] = loss
    return out


def expected(per_rank: list[list[dict[str, Any]]], step: int, spec: dict[str, Any]) -> dict:
    """Every metric of the logging window that ends at ``step`` (its last
    ``logging_steps`` optimizer steps) from all processes' captures."""
    options = spec["options"]
    window = range(step - spec.get("logging_steps", 1) + 1, step + 1)
    items = [item for captures in per_rank for item in captures if item["step"] in window]
    micro_by_rank = with_loss_masks(per_rank, options)
    micro = [item for items in micro_by_rank for item in items if item["step"] in window]
    out = policy_metrics(micro, options)
    out.update(loss_terms(micro_by_rank, window, spec, out.pop("policy_loss")))
    first = [item for item in per_rank[0] if item["step"] in window]
    rewards = [item["rewards"] for item in first if "rewards" in item]
    if rewards:  # generation steps: rewards are gathered, so rank 0's are all of them
        all_rewards = np.concatenate(rewards)
        num_generations = options.get("num_generations", 4)
        zero_std = None
        if options.get("multi_objective_aggregation") == "normalize_then_sum":
            flags = [zero_std_normalized_sum(batch, num_generations) for batch in rewards]
            zero_std = np.concatenate(flags)
        out.update(reward_metrics(all_rewards, num_generations, zero_std))
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


def drift_table(
    runs: dict, trainers: tuple[str, str], splits: list[tuple[int, int]], keys: list[tuple]
) -> str:
    """A markdown table of (step, key) rows: the plain trainer's value at each split,
    then the exact trainer's at each split (docs/trl.md's drift tables)."""
    plain, exact = (
        {f"{p}x{a}": logged(runs[trainer, f"{p}x{a}"]) for p, a in splits} for trainer in trainers
    )
    names = [f"{p}x{a}" for p, a in splits]
    head = " | ".join(
        [f"`GRPOTrainer` {n}" for n in names] + [f"`ExactGRPOTrainer` {n}" for n in names]
    )
    lines = [f"| key | step | {head} |", "|---|---:|" + "---:|" * (2 * len(names))]
    for step, key in keys:
        values = [logs[name][step - 1][key] for logs in (plain, exact) for name in names]
        lines.append(f"| `{key}` | {step} | " + " | ".join(f"{v:.6g}" for v in values) + " |")
    return "\n".join(lines)
