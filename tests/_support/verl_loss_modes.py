"""verl 0.9.1's policy-loss modes over a whole batch, written here in numpy from their
equations (``verl/trainer/ppo/core_algos.py``: the functions ``register_policy_loss``
registers; ``rollout_corr_helper.compute_offpolicy_metrics`` for ``bypass_mode``).

Each function takes one mini-batch as a single micro-batch on one rank would see it
(padded (B, T) arrays, ``m`` the response mask) and returns the metrics the mode's
loss reports, with the meaning verl gives them: token means over the response tokens,
sequence means over the rows, ``actor/pg_loss`` by the mode's aggregation. The
metrics that depend on how the batch is split by design (clip_cov's and kl_cov's
choice of tokens, made per micro-batch) are not here.
"""

from __future__ import annotations

import numpy as np

from verl_formulas import LOG_RATIO_CLAMP, agg_loss, masked_mean, policy_loss

SAFETY_BOUND = 20.0  # rollout_corr_helper's clamp of log-ratios before exp


def _ratio(old: np.ndarray, logp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(log π − log π_old clamped to ±20, its exp)."""
    neg_kl = np.clip(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return neg_kl, np.exp(neg_kl)


def vanilla(old, logp, adv, m, cfg) -> dict:
    """PPO's clipped objective with the dual clip below ``c``."""
    low, high, c, mode = cfg["low"], cfg["high"], cfg["c"], cfg["mode"]
    return policy_loss(old, logp, adv, m, low=low, high=high, c=c, mode=mode, eps=0.0)


def _dppo(old, logp, adv, m, cfg, valid: np.ndarray) -> dict:
    """DPPO's truncated-ratio loss over the tokens ``valid`` keeps."""
    neg_kl, ratio = _ratio(old, logp)
    c = cfg["c"]
    losses = -adv * np.minimum(ratio, c) * logp * valid
    return {
        "actor/pg_loss": agg_loss(losses, m, cfg["mode"], eps=0.0),
        "actor/pg_clipfrac": masked_mean(1.0 - valid, m, eps=0.0),
        "actor/ppo_kl": masked_mean(-neg_kl, m, eps=0.0),
        "actor/pg_clipfrac_lower": masked_mean((ratio > c) * valid, m, eps=0.0),
    }


def dppo_tv(old, logp, adv, m, cfg) -> dict:
    """Tokens kept while the probability moved by at most the clip range (TV)."""
    moved = np.exp(logp) - np.exp(old)
    valid = np.where(adv > 0, moved <= cfg["high"], moved >= -cfg["low"])
    return _dppo(old, logp, adv, m, cfg, valid.astype(float))


def dppo_kl(old, logp, adv, m, cfg) -> dict:
    """Tokens kept while the binary KL stays within the clip range, or the
    probability moved against the advantage."""
    p, p_old = np.exp(logp), np.exp(old)
    binary_kl = p_old * (old - logp) + (1 - p_old) * np.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
    up = (binary_kl <= cfg["high"]) | (p <= p_old)
    down = (binary_kl <= cfg["low"]) | (p >= p_old)
    return _dppo(old, logp, adv, m, cfg, np.where(adv > 0, up, down).astype(float))


def gspo(old, logp, adv, m, cfg) -> dict:
    """The sequence's geometric-mean ratio (log clamped above at 10), clipped."""
    neg_kl = logp - old
    lengths = np.maximum(m.sum(-1), 1)
    seq_log_ratio = np.minimum(np.where(m, neg_kl, 0.0).sum(-1) / lengths, 10.0)
    ratio = np.broadcast_to(np.exp(seq_log_ratio)[:, None], adv.shape)
    loss1 = -adv * ratio
    loss2 = -adv * np.clip(ratio, 1 - cfg["low"], 1 + cfg["high"])
    return {
        "actor/pg_loss": agg_loss(np.maximum(loss1, loss2), m, cfg["mode"], eps=0.0),
        "actor/pg_clipfrac": masked_mean(loss2 > loss1, m, eps=0.0),
        "actor/ppo_kl": masked_mean(-neg_kl, m, eps=0.0),
        "actor/pg_clipfrac_lower": 0.0,
    }


def sapo(old, logp, adv, m, cfg) -> dict:
    """A sigmoid gate of the ratio, temperature by the advantage's sign; always
    aggregated as seq-mean-token-mean (verl ignores loss_agg_mode here)."""
    neg_kl, ratio = _ratio(old, logp)
    tau = np.where(adv > 0, cfg["tau_pos"], cfg["tau_neg"])
    gates = 4.0 / tau / (1.0 + np.exp(-tau * (ratio - 1.0)))
    return {
        "actor/pg_loss": agg_loss(-gates * adv, m, "seq-mean-token-mean", eps=1e-8),
        "actor/pg_clipfrac": 0.0,
        "actor/ppo_kl": masked_mean(-neg_kl, m, eps=0.0),
        "actor/pg_clipfrac_lower": 0.0,
    }


def gpg(old, logp, adv, m, cfg) -> dict:
    """−log π · A, no ratio and no metric of its own."""
    return {"actor/pg_loss": agg_loss(-logp * adv, m, cfg["mode"], eps=0.0)}


def kl_cov(old, logp, adv, m, cfg) -> dict:
    """Its one metric: the mean absolute log-ratio (its loss picks tokens per
    micro-batch)."""
    return {"actor/ppo_kl": masked_mean(np.abs(logp - old), m, eps=0.0)}


def clip_cov(old, logp, adv, m, cfg) -> dict:
    """Its ``ppo_kl`` (unclamped); its clipped tokens are picked per micro-batch."""
    return {"actor/ppo_kl": masked_mean(old - logp, m, eps=0.0)}


def geo_mean(old, logp, adv, m, cfg) -> dict:
    """GMPO: the sequence's geometric mean of token ratios clipped in log space;
    ``pg_loss`` is the plain mean over the rows."""
    neg_kl = logp - old
    sign = np.sign(adv)
    clamped = np.clip(neg_kl, -cfg["low"], cfg["high"])
    kept = sign * np.minimum(sign * neg_kl, sign * clamped)
    n = m.sum(-1)
    ratio = np.exp(np.where(m, kept, 0.0).sum(-1) / (n + 1e-8))
    seq_adv = np.where(m, adv, 0.0).sum(-1) / (n + 1e-8)
    clipped = neg_kl != clamped
    return {
        "actor/pg_loss": float(np.mean(-seq_adv * ratio)),
        "actor/pg_clipfrac": masked_mean(clipped & (adv > 0), m, eps=0.0),
        "actor/ppo_kl": masked_mean(-neg_kl, m, eps=0.0),
        "actor/pg_clipfrac_lower": masked_mean(clipped & (adv < 0), m, eps=0.0),
    }


def dro(old, logp, adv, m, cfg) -> dict:
    """−(log π · A − β/2 · (log π − log π_old)²)."""
    neg_kl = logp - old
    losses = -(logp * adv - 0.5 * cfg["dro_beta"] * neg_kl**2)
    return {
        "actor/pg_loss": agg_loss(losses, m, cfg["mode"], eps=0.0),
        "actor/ppo_kl": masked_mean(-neg_kl, m, eps=0.0),
    }


def cispo(old, logp, adv, m, cfg) -> dict:
    """−sg(clip(ratio)) · A · log π."""
    neg_kl, ratio = _ratio(old, logp)
    clipped = np.clip(ratio, 1 - cfg["low"], 1 + cfg["high"])
    return {
        "actor/pg_loss": agg_loss(-clipped * adv * logp, m, cfg["mode"], eps=0.0),
        "actor/pg_clipfrac": masked_mean(ratio != clipped, m, eps=0.0),
        "actor/ppo_kl": masked_mean(-neg_kl, m, eps=0.0),
        "actor/pg_clipfrac_lower": 0.0,
    }


def off_policy(train: np.ndarray, rollout: np.ndarray, m: np.ndarray) -> dict:
    """``bypass_mode``'s diagnostics of the rollout policy against the trained one:
    token means, means over the rows, and the rows' extremes."""
    row_train = masked_mean(train, m, axis=-1)
    row_rollout = masked_mean(rollout, m, axis=-1)
    log_ratio = train - rollout
    diff = row_rollout - row_train
    rho = np.exp(np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    seq_log_ratio = np.clip(np.where(m, log_ratio, 0.0).sum(-1), -SAFETY_BOUND, SAFETY_BOUND)
    out = {
        "training_ppl": np.exp(-row_train).mean(),
        "training_log_ppl": (-row_train).mean(),
        "kl": masked_mean(rollout - train, m, eps=0.0),
        "k3_kl": masked_mean(np.exp(log_ratio) - log_ratio - 1, m, eps=0.0),
        "rollout_ppl": np.exp(-row_rollout).mean(),
        "rollout_log_ppl": (-row_rollout).mean(),
        "log_ppl_diff": diff.mean(),
        "log_ppl_abs_diff": np.abs(diff).mean(),
        "log_ppl_diff_max": diff.max(),
        "log_ppl_diff_min": diff.min(),
        "ppl_ratio": np.exp(diff).mean(),
        "chi2_token": masked_mean(rho**2, m, eps=0.0) - 1.0,
        "chi2_seq": np.exp(2.0 * seq_log_ratio).mean() - 1.0,
    }
    return {f"rollout_corr/{key}": float(value) for key, value in out.items()}


def bypass_mode(old, logp, adv, m, cfg) -> dict:
    """``old`` is the rollout policy's log-probs: PPO's clipped loss against it
    (``loss_type: ppo_clip``) or REINFORCE (``reinforce``, no IS weights), plus the
    off-policy diagnostics."""
    if cfg.get("loss_type", "ppo_clip") == "reinforce":
        out = {
            "actor/pg_loss": agg_loss(-adv * logp, m, cfg["mode"], eps=0.0),
            "actor/ppo_kl": masked_mean(old - logp, m, eps=0.0),
        }
    else:
        out = vanilla(old, logp, adv, m, cfg)
    return out | off_policy(logp, old, m)


def rejected_by_token_k1(old, logp, m, lower: float, upper: float) -> np.ndarray:
    """``rollout_rs: token_k1``: the response tokens whose ratio π/π_rollout lies
    outside [lower, upper] (the rejection sampling verl applies before the loss)."""
    log_ratio = np.clip(logp - old, -SAFETY_BOUND, SAFETY_BOUND)
    return m & ((log_ratio < np.log(lower)) | (log_ratio > np.log(upper)))


WHOLE_BATCH = {
    "vanilla": vanilla,
    "dppo_tv": dppo_tv,
    "dppo_kl": dppo_kl,
    "gspo": gspo,
    "sapo": sapo,
    "gpg": gpg,
    "clip_cov": clip_cov,
    "kl_cov": kl_cov,
    "geo_mean": geo_mean,
    "dro": dro,
    "cispo": cispo,
    "bypass_mode": bypass_mode,
}
"""Each registered mode's metrics over the whole batch (numpy)."""
