"""verl's PPO/GRPO formulas and batch metrics, written here in numpy from their equations.

The equations are those of verl 0.9.1 (``verl/trainer/ppo/core_algos.py``,
``metric_utils.py``, ``ray_trainer.py`` and ``verl/utils/torch_functional.py``), read for
what they compute; this code is written independently of both verl's and rlmetrics'.
Every masked mean divides by ``count + eps`` as verl does; ``eps`` is a parameter so a
test can also evaluate the exact ratio that rlmetrics reports (DIFFERENCES in
test_rl_verl_parity.py).

Shapes: token tensors (B, T), masks (B, T) bool, per-sequence tensors (B,).
"""

from __future__ import annotations

import numpy as np

VERL_VERSION = "0.9.1"
MEAN_EPS = 1e-8  # masked_mean: Σ m·x / (Σ m + 1e-8)
EXPLAINED_VAR_EPS = 1e-5  # 1 - Var(R - V) / (Var(R) + 1e-5)
LOG_RATIO_CLAMP = 20.0
LOW_VAR_KL_CLAMP = 10.0


def masked_mean(x: np.ndarray, m: np.ndarray, axis: int | None = None, eps: float = MEAN_EPS):
    """Σ m·x / (Σ m + eps), over everything or along ``axis``."""
    return np.where(m, x, 0.0).sum(axis=axis) / (m.sum(axis=axis) + eps)


def masked_whiten(x: np.ndarray, m: np.ndarray, eps: float = MEAN_EPS) -> np.ndarray:
    """(x - μ) / sqrt(σ² + 1e-8), σ² the Bessel-corrected masked variance; raises below 2
    valid tokens, as verl does."""
    n = m.sum()
    if n < 2:
        raise ValueError("masked_var needs at least two valid tokens")
    mu = masked_mean(x, m, eps=eps)
    var = masked_mean((x - mu) ** 2, m, eps=eps) * n / (n - 1)
    return (x - mu) / np.sqrt(var + 1e-8)


def agg_loss(
    losses: np.ndarray, m: np.ndarray, mode: str, scale: float | None = None, eps: float = MEAN_EPS
) -> float:
    """agg_loss on one process holding the whole mini-batch (dp_size 1, global = local).

    token-mean Σ m·l / Σ m; token-sum Σ m·l; seq-mean-token-sum Σ_i Σ_t m·l / S;
    seq-mean-token-sum-norm the same / scale (default: the padded width T);
    seq-mean-token-mean Σ_i (Σ_t m·l / (n_i + eps)) / S; S = sequences with a token.
    """
    lm = np.where(m, losses, 0.0)
    n = m.sum(-1)
    num_seqs = (n > 0).sum()
    if mode == "token-mean":
        return lm.sum() / m.sum()
    if mode == "token-sum":
        return lm.sum()
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        out = lm.sum(-1)[n > 0].sum() / num_seqs
        if mode == "seq-mean-token-sum-norm":
            out = out / (m.shape[-1] if scale is None else scale)
        return out
    if mode == "seq-mean-token-mean":
        kept = n > 0
        return (lm.sum(-1)[kept] / (n[kept] + eps)).sum() / num_seqs
    raise ValueError(mode)


def policy_loss(old, logp, adv, m, *, low, high, c, mode, scale=None, eps=MEAN_EPS) -> dict:
    """compute_policy_loss_vanilla: asymmetric clip, dual clip below c (always on)."""
    neg_kl = np.clip(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = np.exp(neg_kl)
    loss1 = -adv * ratio
    loss2 = -adv * np.clip(ratio, 1 - low, 1 + high)
    clipped1 = np.maximum(loss1, loss2)
    loss3 = -adv * c
    losses = np.where(adv < 0, np.minimum(loss3, clipped1), clipped1)
    return {
        "actor/pg_loss": agg_loss(losses, m, mode, scale, eps),
        "actor/pg_clipfrac": masked_mean(loss2 > loss1, m, eps=eps),
        "actor/ppo_kl": masked_mean(-neg_kl, m, eps=eps),
        "actor/pg_clipfrac_lower": masked_mean((clipped1 > loss3) & (adv < 0), m, eps=eps),
    }


def kl_penalty(logp: np.ndarray, ref: np.ndarray, name: str) -> np.ndarray:
    """kl_penalty's value. A '+' name is straight-through, s - s + f with s = d²/2 and f
    the base estimator (its gradient is k2's, checked separately): f where s is finite,
    NaN where it is not (logp = -inf)."""
    if name.endswith("+"):
        with np.errstate(invalid="ignore"):
            s = 0.5 * (logp - ref) ** 2
            return (s - s) + kl_penalty(logp, ref, name[:-1])
    base = name
    d = logp - ref
    if base in ("kl", "k1"):
        return d
    if base == "abs":
        return np.abs(d)
    if base in ("mse", "k2"):
        return 0.5 * d**2
    if base in ("low_var_kl", "k3"):
        with np.errstate(invalid="ignore", over="ignore"):
            k = np.clip(ref - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            return np.clip(np.exp(k) - k - 1, -LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    raise ValueError(name)


def entropy(logits: np.ndarray) -> np.ndarray:
    """logsumexp(z) - Σ softmax(z)·z over the last axis."""
    top = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    p = np.exp(logits - lse[..., None])
    return lse - (p * logits).sum(-1)


def value_loss(vpreds, values, returns, m, *, clip, mode, scale=None, eps=MEAN_EPS) -> dict:
    """compute_value_loss: 0.5 · agg(max((v - R)², (clip(v, v_old ± c) - R)²))."""
    vclipped = np.clip(vpreds, values - clip, values + clip)
    loss1, loss2 = (vpreds - returns) ** 2, (vclipped - returns) ** 2
    return {
        "critic/vf_loss": 0.5 * agg_loss(np.maximum(loss1, loss2), m, mode, scale, eps),
        "critic/vf_clipfrac": masked_mean(loss2 > loss1, m, eps=eps),
        "critic/vpred_mean": masked_mean(vpreds, m, eps=eps),
    }


def update_metrics(
    *, old, logp, adv, entropy, ref, vpreds, values, returns, m, low, high, c, kl_name, clip
) -> dict[str, float]:
    """verl's actor and critic update metrics over the tokens of ``m`` (token-mean, the
    exact ratios: no eps): the policy loss and clip fractions, the entropy and KL losses
    (``kl_name``: the actor's ``kl_loss_type``) and the value loss."""
    out = policy_loss(old, logp, adv, m, low=low, high=high, c=c, mode="token-mean", eps=0.0)
    out["actor/entropy_loss"] = masked_mean(entropy, m, eps=0.0)
    out["actor/kl_loss"] = masked_mean(kl_penalty(logp, ref, kl_name), m, eps=0.0)
    out |= value_loss(vpreds, values, returns, m, clip=clip, mode="token-mean", eps=0.0)
    return {name: float(value) for name, value in out.items()}


def gae(rewards, values, m, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """compute_gae_advantage_return: raw advantages and returns (before whitening); a
    masked token carries the next valid token's value and advantage."""
    next_value = np.zeros(len(rewards))
    last = np.zeros(len(rewards))
    adv = np.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        new = delta + gamma * lam * last
        mt = m[:, t].astype(float)
        next_value = values[:, t] * mt + (1 - mt) * next_value
        last = new * mt + (1 - mt) * last
        adv[:, t] = last
    return adv, adv + values


def grpo(scores, index, m, eps: float = 1e-6, norm_by_std: bool = True) -> np.ndarray:
    """compute_grpo_outcome_advantage: a group of one takes mean 0 and std 1."""
    out = np.empty_like(scores)
    for g in set(index.tolist()):
        rows = index == g
        group = scores[rows]
        mean, std = (0.0, 1.0) if len(group) == 1 else (group.mean(), group.std(ddof=1))
        out[rows] = (group - mean) / (std + eps) if norm_by_std else group - mean
    return out[:, None] * m


def reward_kl_penalty(old, ref, m, name: str, beta: float, eps: float = MEAN_EPS) -> dict:
    """apply_kl_penalty's metrics: the mean over rows of each row's token mean."""
    kld = kl_penalty(old, ref, name) * m
    current = masked_mean(kld, m, axis=-1, eps=eps).mean()
    return {"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": beta}


def stats(name: str, x: np.ndarray) -> dict:
    return {f"{name}/mean": x.mean(), f"{name}/max": x.max(), f"{name}/min": x.min()}


def data_metrics(b: dict, ev_eps: float = EXPLAINED_VAR_EPS) -> dict:
    """compute_data_metrics: scores and rewards of non-aborted rows, token statistics,
    lengths (clip ratio: equal to the padded widths), explained variance (ddof=1)."""
    m, pm = b["response_mask"], b["prompt_mask"]
    lengths, plengths = m.sum(-1).astype(float), pm.sum(-1).astype(float)
    kept = lengths > 0
    ret, val = b["returns"][m], b["values"][m]
    width = m.shape[-1]
    out = {
        **stats("critic/score", b["token_scores"].sum(-1)[kept]),
        **stats("critic/rewards", b["token_rewards"].sum(-1)[kept]),
        **stats("critic/advantages", b["advantages"][m]),
        **stats("critic/returns", ret),
        **stats("critic/values", val),
        "critic/vf_explained_var": 1 - np.var(ret - val, ddof=1) / (np.var(ret, ddof=1) + ev_eps),
        **stats("response_length", lengths),
        "response_length/clip_ratio": (lengths == width).mean(),
        **stats("response_length_non_aborted", lengths[kept]),
        "response_length_non_aborted/clip_ratio": (lengths[kept] == width).mean(),
        "response/aborted_ratio": (~kept).mean(),
        **stats("prompt_length", plengths),
        "prompt_length/clip_ratio": (plengths == pm.shape[-1]).mean(),
    }
    return {k: float(v) for k, v in out.items()}


def timing(timing_raw: dict, response_tokens: float, all_tokens: float) -> dict:
    """compute_timing_metrics: per-token ms for gen (response tokens) and the stages
    ref, values, adv, update_critic, update_actor (prompt + response tokens)."""
    per = {"gen": response_tokens} | dict.fromkeys(
        ("ref", "values", "adv", "update_critic", "update_actor"), all_tokens
    )
    out = {f"timing_s/{k}": v for k, v in timing_raw.items()}
    out |= {
        f"timing_per_token_ms/{k}": v * 1000 / per[k] for k, v in timing_raw.items() if k in per
    }
    return out


def throughput(total_tokens: float, step_seconds: float, n_gpus: int) -> dict:
    """compute_throughout_metrics."""
    return {
        "perf/total_num_tokens": total_tokens,
        "perf/time_per_step": step_seconds,
        "perf/throughput": total_tokens / (step_seconds * n_gpus),
    }
